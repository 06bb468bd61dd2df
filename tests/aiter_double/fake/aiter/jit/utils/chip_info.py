"""GPU architecture of the emulated device, found the way the real get_gfx finds it: from the
GPU_ARCHS environment variable (the last of a ';' list), which activate() sets. The real one falls
back to rocminfo when GPU_ARCHS is unset or "native"; a CPU host has none, so both raise."""
import functools
import os

GFX_MAP = {
    0: "native",
    1: "gfx90a",
    2: "gfx908",
    3: "gfx940",
    4: "gfx941",
    5: "gfx942",
    6: "gfx945",
    7: "gfx1100",
    8: "gfx950",
}
_CU_NUM_BY_GFX = {"gfx942": 304, "gfx950": 256}  # MI300X, MI355X


@functools.lru_cache(maxsize=1)
def get_gfx():
    gfx = os.getenv("GPU_ARCHS", "native")
    if gfx == "native":
        raise RuntimeError("Get GPU arch from rocminfo failed: no rocminfo on this host (set GPU_ARCHS)")
    gfx = gfx.split(";")[-1]
    if gfx not in GFX_MAP.values():
        raise KeyError(f"Unknown GPU architecture: {gfx}. Supported architectures: {list(GFX_MAP.values())}")
    return gfx


@functools.lru_cache(maxsize=1)
def get_cu_num():
    """CU_NUM if set (as the real one), else the compute units of the emulated part."""
    return int(os.getenv("CU_NUM", 0)) or _CU_NUM_BY_GFX.get(get_gfx(), 304)
