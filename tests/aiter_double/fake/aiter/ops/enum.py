"""QuantType and ActivationType: pybind11 enums in the real aiter (csrc/include/aiter_enum.h).

Same member names and values here, and the same manners: they convert to int (int(), .value) but do
not compare equal to ints, and print as "QuantType.per_Token".
"""
import enum as _enum

__all__ = ["ActivationType", "QuantType"]


class _PybindEnum(_enum.Enum):
    def __int__(self):
        return self.value

    def __index__(self):
        return self.value

    def __str__(self):
        return f"{type(self).__name__}.{self.name}"


class ActivationType(_PybindEnum):
    No = -1
    Silu = 0
    Gelu = 1
    Swiglu = 2


class QuantType(_PybindEnum):
    No = 0
    per_Tensor = 1
    per_Token = 2
    per_1x32 = 3
    per_1x128 = 4
    per_128x128 = 5
