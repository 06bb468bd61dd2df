"""The MORI double and the MORI exchange use the real MORI API: the names, parameters and defaults of
amd-mori, read with `ast` (importing it needs ROCm).

amd-mori has wheels for CPython 3.12 on glibc 2.39 only, so `pip install amd-mori` fails here (3.11);
its Python source installs anywhere with
    pip install --no-deps --target .amd-mori --python-version 3.12 --platform manylinux_2_39_x86_64 \
        --only-binary=:all: amd-mori==1.2.4
into .amd-mori/ at the repository root, where this test looks after the installed packages.
ATOM_RAY_REQUIRE_AMD_MORI=1 turns the skip for a missing package into a failure.
"""
from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import sys
from pathlib import Path

import pytest

import mori_double
from aiter_double.static_api import Call, PackageIndex, Signature, call_problems, scan_calls

MORI_VERSION = "1.2.4"
INSTALL = (f"pip install --no-deps --target .amd-mori --python-version 3.12 --platform manylinux_2_39_x86_64 "
           f"--only-binary=:all: amd-mori=={MORI_VERSION}")
REPO = Path(__file__).resolve().parents[2]
ADAPTER = REPO / "engine/parallel/mori_all_to_all.py"
FAKE = PackageIndex(mori_double.FAKE_ROOT, package="mori")
OP = "mori.ops.EpDispatchCombineOp"
CONFIG = "mori.ops.EpDispatchCombineConfig"
KERNEL_TYPE = "mori.ops.EpDispatchCombineKernelType"


@pytest.fixture(scope="module")
def real() -> PackageIndex:
    found = list(importlib.metadata.distributions(name="amd-mori", path=[*sys.path, str(REPO / ".amd-mori")]))
    if not found:
        message = f"amd-mori's source is not installed; {INSTALL}"
        if os.environ.get("ATOM_RAY_REQUIRE_AMD_MORI") == "1":
            pytest.fail(f"ATOM_RAY_REQUIRE_AMD_MORI=1 but {message}")
        pytest.skip(message)
    if found[0].version != MORI_VERSION:
        pytest.fail(f"amd-mori {found[0].version} is installed, the double follows {MORI_VERSION}: {INSTALL}, "
                    f"or update the double and MORI_VERSION")
    return PackageIndex(Path(found[0].locate_file("mori")).parent, package="mori")


def dataclass_signature(index: PackageIndex, dotted: str) -> Signature:
    """A dataclass's constructor, from its annotated fields."""
    found = index.resolve(dotted)
    assert found is not None and found.kind == "class", f"{dotted} is not a class"
    fields = [s for s in found.node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    defaults = {s.target.id: ast.unparse(s.value) for s in fields if s.value is not None}
    return Signature(tuple(s.target.id for s in fields), (), defaults, False, False)


def kernel_types(index: PackageIndex) -> dict[str, int]:
    """The real kernel types, from the C++ enum that pybind binds; the double's, from its Python enum."""
    header = index.root / "mori/_jit-sources/include/mori/ops/dispatch_combine/dispatch_combine.hpp"
    if header.is_file():
        body = re.search(r"enum KernelType\s*\{(.*?)\};", header.read_text(), re.S).group(1)
        return {name: int(value) for name, value in re.findall(r"(\w+)\s*=\s*(\d+)", body)}
    found = index.resolve(KERNEL_TYPE)
    return {s.targets[0].id: ast.literal_eval(s.value) for s in found.node.body if isinstance(s, ast.Assign)}


# ------------------------------------------------------------------ check 1: the double's own API

DOUBLE_DEFINITIONS = sorted(FAKE.public_definitions().items())


@pytest.mark.parametrize("dotted, kind", DOUBLE_DEFINITIONS, ids=[d for d, _ in DOUBLE_DEFINITIONS])
def test_double_definition_exists_in_real_mori(real, dotted, kind):
    found = real.resolve(dotted)
    assert found is not None, f"the double defines {dotted}, which the real mori {MORI_VERSION} does not have"
    if kind != "function":
        return
    ours, theirs = FAKE.signature(dotted), real.signature(dotted)
    assert theirs is not None, f"the double's {dotted} is a function; in the real mori it is a {found.kind}"
    assert ours.names == theirs.names[: len(ours.names)], (
        f"{dotted}: the double takes ({ours.describe()}), the real mori {MORI_VERSION} ({theirs.describe()})")
    assert ours.positional == theirs.positional[: len(ours.positional)], f"{dotted}: keyword-only mismatch"
    for name in ours.names:
        assert ours.defaults.get(name) == theirs.defaults.get(name), (
            f"{dotted}: parameter {name!r} defaults to {ours.defaults.get(name)} in the double, "
            f"{theirs.defaults.get(name)} in the real mori")
    omitted = [n for n in theirs.names[len(ours.names):] if n not in theirs.defaults]
    assert not omitted, f"{dotted}: the double omits required parameters {omitted}"


def test_double_config_has_the_real_fields_and_defaults(real):
    ours, theirs = dataclass_signature(FAKE, CONFIG), dataclass_signature(real, CONFIG)
    assert ours == theirs, f"the double's config ({ours.describe()}), the real one ({theirs.describe()})"


def test_double_kernel_types_are_the_real_ones(real):
    assert kernel_types(FAKE) == kernel_types(real)


# -------------------------------------------------------------- check 2: the adapter's mori calls

def adapter_calls() -> list[Call]:
    """`mori.*(...)` calls, and the op's methods called as `self.op.<method>(...)`."""
    source = ADAPTER.read_text()
    path = str(ADAPTER.relative_to(REPO))
    calls = scan_calls(source, path, package="mori")
    for node in ast.walk(ast.parse(source)):
        func = node.func if isinstance(node, ast.Call) else None
        if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute) and func.value.attr == "op"
                and isinstance(func.value.value, ast.Name) and func.value.value.id == "self"):
            calls.append(Call(path, node.lineno, f"{OP}.{func.attr}", len(node.args),
                              tuple(k.arg for k in node.keywords if k.arg is not None),
                              any(k.arg is None for k in node.keywords)))
    return sorted(calls, key=lambda c: c.line)


ADAPTER_CALLS = adapter_calls()


def check_call(call: Call, index: PackageIndex, owner: str) -> list[str]:
    if index.resolve(call.target) is None:
        return [f"{call.where} calls {call.target}, which {owner} does not have"]
    signature = dataclass_signature(index, CONFIG) if call.target == CONFIG else index.signature(call.target)
    if signature is None:
        return []  # a class: existence is all ast can check
    return [f"{call.where} calls {call.target} with {problem} ({owner}; params: {signature.describe()})"
            for problem in call_problems(call, signature)]


def test_the_adapter_calls_what_the_double_checks():
    assert {c.target for c in ADAPTER_CALLS} == {
        "mori.shmem.shmem_torch_process_group_init", "mori.shmem.shmem_finalize", CONFIG, OP,
        f"{OP}.dispatch", f"{OP}.combine"}


@pytest.mark.parametrize("call", ADAPTER_CALLS, ids=[f"{c.where}-{c.target}" for c in ADAPTER_CALLS])
def test_adapter_call_binds_to_real_mori(real, call):
    problems = check_call(call, real, f"the real mori {MORI_VERSION}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("call", ADAPTER_CALLS, ids=[f"{c.where}-{c.target}" for c in ADAPTER_CALLS])
def test_adapter_call_binds_to_the_double(call):
    problems = check_call(call, FAKE, "the mori double")
    assert not problems, "\n".join(problems)


def test_the_adapters_kernel_type_exists_in_real_mori(real):
    assert "EpDispatchCombineKernelType.IntraNode" in ADAPTER.read_text()
    assert "IntraNode" in kernel_types(real)


# ------------------------------------------------ check 3: the kernel semantics the exchange relies on

def intranode_kernel(index: PackageIndex) -> str:
    return (index.root / "mori/_jit-sources/src/ops/dispatch_combine/intranode.hpp").read_text()


def test_real_dispatch_sends_a_token_once_per_rank(real):
    # A slot is skipped when an earlier slot of the token goes to the same rank (MoriAllToAll's rows carry
    # a token's k slots, of which it keeps its own rank's).
    assert "condition = (otherExpert >= 0) && (destPe == (otherExpert / config.numExpertPerRank));" in (
        intranode_kernel(real))


def test_real_combine_sums_expert_outputs_unweighted(real):
    # No scales in the sum: the routing weights, applied by our expert op, are not applied again.
    assert "core::WarpAccumLF<T, 16>(outPtr, srcPtrs, nullptr, validAccumCount, hiddenDimSize);" in (
        intranode_kernel(real))
