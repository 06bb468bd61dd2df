"""The aiter double and the aiter backend use the real AITER API: the names, parameters and defaults
of the installed amd-aiter, read with `ast` (importing it needs ROCm).

CI installs it (`pip install --no-deps amd-aiter==0.1.7.post2.dev18`) and sets
ATOM_RAY_REQUIRE_AMD_AITER=1, which turns the skip for a missing package into a failure.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import pytest

import aiter_double
from aiter_double.static_api import PackageIndex, call_problems, scan_calls

AITER_VERSION = "0.1.7.post2.dev18"
INSTALL = f"pip install --no-deps amd-aiter=={AITER_VERSION}"
REPO = Path(__file__).resolve().parents[2]
BACKEND_DIRS = ("engine/kernels/aiter", "engine/parallel")
FAKE = PackageIndex(aiter_double.FAKE_ROOT)


@pytest.fixture(scope="module")
def real() -> PackageIndex:
    try:
        dist = importlib.metadata.distribution("amd-aiter")
    except importlib.metadata.PackageNotFoundError:
        message = f"amd-aiter is not installed; {INSTALL}"
        if os.environ.get("ATOM_RAY_REQUIRE_AMD_AITER") == "1":
            pytest.fail(f"ATOM_RAY_REQUIRE_AMD_AITER=1 but {message}")
        pytest.skip(message)
    if dist.version != AITER_VERSION:
        pytest.fail(f"amd-aiter {dist.version} is installed, the double follows {AITER_VERSION}: {INSTALL}, "
                    f"or update the double and AITER_VERSION")
    return PackageIndex(Path(dist.locate_file("aiter")).parent)


# ------------------------------------------------------------------ check 1: the double's own API

DOUBLE_DEFINITIONS = sorted(FAKE.public_definitions().items())


@pytest.mark.parametrize("dotted, kind", DOUBLE_DEFINITIONS, ids=[d for d, _ in DOUBLE_DEFINITIONS])
def test_double_definition_exists_in_real_aiter(real, dotted, kind):
    found = real.resolve(dotted)
    assert found is not None, f"the double defines {dotted}, which the real aiter {AITER_VERSION} does not have"
    if kind != "function":
        return
    ours, theirs = FAKE.signature(dotted), real.signature(dotted)
    assert theirs is not None, f"the double's {dotted} is a function; in the real aiter it is a {found.kind}"
    assert ours.names == theirs.names[: len(ours.names)], (
        f"{dotted}: the double takes ({ours.describe()}), the real aiter {AITER_VERSION} ({theirs.describe()})")
    assert ours.positional == theirs.positional[: len(ours.positional)], f"{dotted}: keyword-only mismatch"
    for name in ours.names:
        assert ours.defaults.get(name) == theirs.defaults.get(name), (
            f"{dotted}: parameter {name!r} defaults to {ours.defaults.get(name)} in the double, "
            f"{theirs.defaults.get(name)} in the real aiter")
    omitted = [n for n in theirs.names[len(ours.names):] if n not in theirs.defaults]
    assert not omitted, f"{dotted}: the double omits required parameters {omitted}"


TOP_LEVEL = FAKE.top_level_functions()


@pytest.mark.parametrize("dotted", TOP_LEVEL)
def test_double_reexports_like_real_aiter(real, dotted):
    ours, theirs = FAKE.resolve(dotted), real.resolve(dotted)
    assert theirs is not None and theirs.kind == "function", (
        f"the double exports `{dotted}`; the real aiter {AITER_VERSION} has no such top-level function")
    assert theirs.module == ours.module, (
        f"`{dotted}` comes from {ours.module} in the double, {theirs.module} in the real aiter")


def test_double_enums_match_the_real_pybind_enums(real):
    header = (real.root / "aiter_meta/csrc/include/aiter_enum.h").read_text()  # what pybind11 binds
    real_enums = {}
    for name, body in re.findall(r"enum class (\w+)\s*:\s*int\s*\{(.*?)\};", header, re.S):
        value, members = -1, {}
        for entry in (e.strip() for e in body.split(",") if e.strip()):
            member, _, explicit = (part.strip() for part in entry.partition("="))
            value = int(explicit) if explicit else value + 1
            members[member] = value
        real_enums[name] = members
    with aiter_double.activate() as aiter:
        for name in ("QuantType", "ActivationType"):
            assert {m.name: m.value for m in getattr(aiter, name)} == real_enums[name], name


# -------------------------------------------------------------- check 2: the backend's aiter calls

def backend_calls():
    files = sorted(p for d in BACKEND_DIRS if (REPO / d).is_dir() for p in (REPO / d).rglob("*.py"))
    calls = [c for path in files for c in scan_calls(path.read_text(), str(path.relative_to(REPO)))]
    if not (REPO / BACKEND_DIRS[0]).is_dir():
        skip = pytest.mark.skip(reason=f"{BACKEND_DIRS[0]}/ does not exist yet")
        return [pytest.param(None, id="no-engine-kernels-aiter-yet", marks=skip)]
    if not calls:
        skip = pytest.mark.skip(reason="the backend calls no aiter function")
        return [pytest.param(None, id="no-aiter-calls", marks=skip)]
    return [pytest.param(c, id=f"{c.where}-{c.target}") for c in calls]


def check_call(call, index: PackageIndex, owner: str) -> list[str]:
    """Readable failures of one call against one copy of aiter."""
    if index.resolve(call.target) is None:
        return [f"{call.where} calls {call.target}, which {owner} does not have"]
    signature = index.signature(call.target)
    if signature is None:
        return []  # a class or a pybind type: existence is all ast can check
    failures = []
    for problem in call_problems(call, signature):
        unknown = re.fullmatch(r"keyword '\w+'", problem)
        failures.append(f"{call.where} calls {call.target} with {problem}"
                        + (f" which {owner} does not have" if unknown else f" ({owner})")
                        + f" (params: {signature.describe()})")
    return failures


BACKEND_CALLS = backend_calls()


@pytest.mark.parametrize("call", BACKEND_CALLS)
def test_backend_call_binds_to_real_aiter(real, call):
    problems = check_call(call, real, f"the real aiter {AITER_VERSION}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("call", BACKEND_CALLS)
def test_backend_call_binds_to_the_double(call):
    problems = check_call(call, FAKE, "the aiter double")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------ the scanner, proven now

SYNTHETIC_BACKEND = '''
import torch
import aiter as ai
from aiter.fused_moe import fused_moe
from aiter.ops.shuffle import shuffle_weight as shuffle


def forward(x, w):
    import aiter
    w = shuffle(w, layout=(16, 16))
    y = aiter.gemm_a8w8_bpreshuffle(x, w, 1, 2, dtype=torch.bfloat16)
    aiter.tuned_gemm.tgemm.mm(x, w, otype=torch.bfloat16)
    ai.pa_fwd_asm(x, w, w, w, w, 16, kernelNmae="x")
    fused_moe(*x)
    return torch.relu(y)
'''


def test_scanner_finds_every_aiter_call_form():
    calls = scan_calls(SYNTHETIC_BACKEND, "synthetic.py")
    assert [(c.line, c.target, c.positional, c.keywords, c.unpacked) for c in calls] == [
        (10, "aiter.ops.shuffle.shuffle_weight", 1, ("layout",), False),
        (11, "aiter.gemm_a8w8_bpreshuffle", 4, ("dtype",), False),
        (12, "aiter.tuned_gemm.tgemm.mm", 2, ("otype",), False),
        (13, "aiter.pa_fwd_asm", 6, ("kernelNmae",), False),
        (14, "aiter.fused_moe.fused_moe", 0, (), True),
    ]


def test_scanner_reports_a_misspelt_keyword_with_the_parameters():
    call = next(c for c in scan_calls(SYNTHETIC_BACKEND, "synthetic.py") if c.target == "aiter.pa_fwd_asm")
    [problem] = check_call(call, FAKE, "the aiter double")
    assert problem.startswith(
        "synthetic.py:13 calls aiter.pa_fwd_asm with keyword 'kernelNmae' which the aiter double does not have")
    assert "block_tables_stride0, max_qlen=1" in problem


def test_scanner_reports_missing_names_and_surplus_positionals():
    source = "import aiter\naiter.pa_persistent_fwd(1)\naiter.silu_and_mul(1, 2, 3)\naiter.rmsnorm2d_fwd(x, w)\n"
    problems = [p for c in scan_calls(source, "s.py") for p in check_call(c, FAKE, "the aiter double")]
    assert problems[0] == "s.py:2 calls aiter.pa_persistent_fwd, which the aiter double does not have"
    assert "3 positional arguments where it takes at most 2" in problems[1]
    assert "no value for required epsilon" in problems[2]


def test_resolver_follows_reexports_classes_and_instances():
    assert FAKE.resolve("aiter.rmsnorm2d_fwd").module == "aiter.ops.rmsnorm"
    assert FAKE.signature("aiter.tuned_gemm.tgemm.mm").positional[:2] == ("inp", "weights")
    assert FAKE.resolve("aiter.dtypes.fp8").kind == "value"
    assert FAKE.resolve("aiter.no_such_kernel") is None


def test_real_aiter_has_the_names_the_backend_plan_relies_on(real):
    for dotted in ("aiter.pa_fwd_asm", "aiter.fused_moe.fused_moe", "aiter.tuned_gemm.tgemm.mm",
                   "aiter.ops.shuffle.shuffle_weight", "aiter.utility.fp4_utils.e8m0_shuffle", "aiter.get_hip_quant"):
        assert real.signature(dotted) is not None, dotted
    assert real.resolve("aiter.pa_persistent_fwd") is None  # not in 0.1.7


def test_real_aiter_mla_api_is_what_the_mla_adapter_assumes(real):
    """engine/kernels/aiter/mla.py's design rests on these 0.1.7 facts: mla_decode_fwd takes no page_size
    (the cache's page size is kv_buffer's dim 1) and returns no log-sum-exp (no return_lse: the sparse op
    computes it beside); the HIP fused rope + MLA cache write does not exist yet (only a Triton variant)."""
    decode = real.signature("aiter.mla.mla_decode_fwd")
    assert decode.names[:8] == ("q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices",
                                "kv_last_page_lens", "max_seqlen_q")
    assert "return_lse" not in decode.names and "page_size" not in decode.names
    assert real.signature("aiter.concat_and_cache_mla").names == (
        "kv_c", "k_pe", "kv_cache", "slot_mapping", "kv_cache_dtype", "scale")
    assert real.signature("aiter.mla.mla_prefill_fwd") is not None
    assert real.resolve("aiter.fused_qk_rope_concat_and_cache_mla") is None
    assert real.signature("aiter.ops.triton.fused_kv_cache.fused_qk_rope_cat_and_cache_mla") is not None
