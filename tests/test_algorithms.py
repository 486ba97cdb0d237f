"""The kernel descriptions of bf16opt/algorithms.py are the one source of roles, scalars and flags.

The CUDA kernels name their chunk-table roles and flag bits in enums; these tests parse
``cuda_src/<algorithm>.cu`` and fail when an enum, or the kernel's scalar parameters, drift
from the description.  The configuration derived from (description, plan, flags) is checked
against the precision rules for every allowed plan.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

from bf16opt.algorithms import ALGORITHMS, kernel_config
from bf16opt.precision import all_plans

CUDA_SRC = Path(__file__).resolve().parent.parent / "cuda_src"


def camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def enum_entries(source: str, enum: str) -> dict:
    match = re.search(r"enum\s+" + enum + r"\s*\{([^}]*)\}", source)
    assert match, f"enum {enum} not found"
    entries = {}
    for item in match.group(1).split(","):
        if item.strip():
            key, value = (part.strip() for part in item.split("="))
            entries[key] = int(value, 0)
    return entries


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_cuda_role_and_flag_enums_follow_the_description(name):
    algorithm = ALGORITHMS[name]
    source = (CUDA_SRC / f"{name}.cu").read_text(encoding="utf-8")
    prefix = "k" + camel(name)
    roles = {f"{prefix}{camel(role.name)}": k for k, role in enumerate(algorithm.roles)}
    roles[f"{prefix}Roles"] = len(algorithm.roles)
    assert enum_entries(source, camel(name) + "Role") == roles
    flags = {f"{prefix}{camel(flag)}": 1 << k for k, flag in enumerate(algorithm.runtime_flags)}
    assert enum_entries(source, camel(name) + "Flag") == flags


def test_cuda_shared_flag_bit_follows_the_description():
    """kFloat32Grad (float32 grads of 16-bit params) is FLOAT32_GRAD_BIT, kLiveLrDouble (a
    capturable step's float64 lr tensor) LIVE_LR_DOUBLE_BIT, both above every algorithm's own
    run-time bits."""
    from bf16opt.algorithms import FLOAT32_GRAD_BIT, LIVE_LR_DOUBLE_BIT

    source = (CUDA_SRC / "multi_tensor.cuh").read_text(encoding="utf-8")
    for bit in (15, 13):
        source = source.replace(f"1 << {bit}", str(1 << bit))
    assert enum_entries(source, "SharedFlag") == {"kFloat32Grad": FLOAT32_GRAD_BIT,
                                                  "kLiveLrDouble": LIVE_LR_DOUBLE_BIT}
    assert all(LIVE_LR_DOUBLE_BIT > 1 << len(a.runtime_flags) for a in ALGORITHMS.values())


def test_grad_dtype_is_part_of_the_configuration():
    """float32 grads of 16-bit params: the grad role's dtype and the kernels' flag bit; other
    grad dtypes are refused."""
    from bf16opt.algorithms import FLOAT32_GRAD_BIT, grad_dtypes

    for plan in all_plans(quality=True):
        for name, algorithm in ALGORITHMS.items():
            for grad in grad_dtypes(plan.param):
                config = kernel_config(algorithm, plan, grad=grad)
                assert config.dtypes[1] == config.grad == grad
                assert config.dtypes[0] == plan.param and config.dtypes[2:] == kernel_config(algorithm, plan).dtypes[2:]
                assert bool(config.flag_bits & FLOAT32_GRAD_BIT) == (grad != plan.param)
            with pytest.raises(ValueError, match="grads"):
                kernel_config(algorithm, plan, grad=torch.float64)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_cuda_kernel_takes_the_description_scalars_in_order(name):
    algorithm = ALGORITHMS[name]
    source = (CUDA_SRC / f"{name}.cu").read_text(encoding="utf-8")
    match = re.search(r"__global__\s+void\s+" + name + r"_kernel\s*\(([^)]*)\)", source)
    assert match, f"{name}_kernel not found"
    parameters = [p.split()[-1] for p in match.group(1).replace("\n", " ").split(",")]
    after_flags = parameters[parameters.index("flags") + 1:]
    assert after_flags[0] == "BF16OPT_LIVE_PARAMETERS"  # (a live step's inputs, multi_tensor.cuh)
    assert after_flags[1:] == list(algorithm.scalars._fields)
    template = re.search(r"template\s*<([^>]*)>\s*__global__\s+void\s+" + name + "_kernel", source)
    flags = [p.split("=")[0].split()[-1] for p in template.group(1).split(",") if p.split()[0] == "bool"]
    # (LIVE, defaulted to false: capturable steps' instantiations, cupy.kernel_name(config, live=True))
    assert flags == [flag.upper() for flag in algorithm.template_flags] + ["TRACK", "LIVE"]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_kernel_config_follows_the_plan(name):
    """For every allowed plan and flag set: the companion is the plan's one master-policy
    buffer, moments take their plan field's dtype, conditional roles exist only with their flag."""
    algorithm = ALGORITHMS[name]
    for plan, values in itertools.product(all_plans(quality=True),
                                          itertools.product((False, True), repeat=len(algorithm.flags))):
        flags = tuple(zip(algorithm.flags, values))
        config = kernel_config(algorithm, plan, flags)
        assert config is kernel_config(algorithm, plan, flags)  # memoised: identity is a cache key
        by_name = {role.name: (dtype, key) for role, dtype, key
                   in zip(algorithm.roles, config.dtypes, config.state_keys)}
        assert by_name["param"][0] == by_name["grad"][0] == plan.param
        companion = {"copy": plan.master, "kahan": plan.compensation_dtype, "remainder": torch.int16,
                     "param": None}[plan.weights]
        assert by_name["companion"][0] == companion
        assert (config.weights == "param-stochastic") == (plan.weights == "param" and plan.rounding == "stochastic")
        for role in algorithm.moment_roles:
            present = role.when is None or dict(flags)[role.when]
            assert by_name[role.name] == ((getattr(plan, role.storage), role.name) if present else (None, None))
        assert set(config.state_buffers()) == {key for _, _, _, key in config.present()} - {"param", "grad"}


def test_unknown_flag_is_refused():
    with pytest.raises(ValueError, match="nesterov"):
        kernel_config(ALGORITHMS["adam"], all_plans()[0], (("nesterov", True),))


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_numba_chunk_function_reads_every_role(name):
    """cpu_src/<name>.py's chunk_function takes one format per role and the description's
    flags (maximize excepted: a run-time sign), so a role added to the description
    without the kernel fails here."""
    import inspect

    module = pytest.importorskip(f"bf16opt._cpu.{name}")
    parameters = list(inspect.signature(module.chunk_function).parameters)
    assert parameters[:4] == ["formats", "weights", "moment_rounding", "track"]
    # (``unit``: the variant without multiplications by 1, chosen per call from the scalars;
    # ``q8_rounding``: how q8 moments round, a storage setting rather than a flag)
    assert set(parameters[4:]) - {"unit", "q8_rounding"} == set(ALGORITHMS[name].flags) - {"maximize"}
    assert "unit" in parameters and "q8_rounding" in parameters
    source = inspect.getsource(module.chunk_function)
    assert f"row[{len(ALGORITHMS[name].roles)}]" in source  # the element count follows the roles


# ---------------------------------------------------------------- each state's buffer and q8 map
# bf16opt._cpu.roles.STATE_ROLES states them once; the Python side of every backend reads it,
# the CUDA sources name the buffers in C++: these tests tie them to the table.
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_states_of_one_update_round_with_their_own_buffers(name):
    """No two arrays an update rounds share a buffer (their roundings would be correlated)."""
    buffers = [role.buffer for role in ALGORITHMS[name].roles if role.buffer is not None]
    assert len(buffers) == len(set(buffers))


def test_cuda_buffer_numbers_follow_the_table():
    from bf16opt._cpu.roles import EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ, STREAMS, WEIGHTS

    source = (CUDA_SRC / "storage.cuh").read_text(encoding="utf-8")
    assert enum_entries(source, "Buffer") == {"kWeights": WEIGHTS, "kExpAvg": EXP_AVG,
                                              "kExpAvgSq": EXP_AVG_SQ, "kMaxExpAvgSq": MAX_EXP_AVG_SQ,
                                              "kBuffers": 4}
    assert int(re.search(r"enum\s*\{\s*kStreams\s*=\s*(\d+)\s*\}", source).group(1)) == STREAMS


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_cuda_states_round_with_their_table_buffers(name):
    """cuda_src/<name>.cu rounds each state with its row's buffer: in the element loop (the
    bits ``load_bits`` read from the state's array, encoded with ``streams.at(kBuffer, i)``)
    and in the q8 blocks (``Q8Slot<role, S, kBuffer, ...>``); the param with kWeights."""
    algorithm = ALGORITHMS[name]
    source = (CUDA_SRC / f"{name}.cu").read_text(encoding="utf-8")
    numbers = enum_entries((CUDA_SRC / "storage.cuh").read_text(encoding="utf-8"), "Buffer")
    bits_of = dict(re.findall(r"load_bits<VEC>\((\w+), index, (\w+)\)", source))
    encoded = {bits: numbers[buffer] for bits, buffer
               in re.findall(r"(\w+)\[k\] = \w+::encode\([^;]*streams\.at\((k\w+), i\)\)", source)}
    slots = {role: numbers[buffer] for role, buffer in re.findall(r"Q8Slot<(k\w+), \w+, (k\w+)", source)}
    for role in algorithm.moment_roles:
        assert encoded[bits_of[role.name]] == role.buffer, f"{name}.cu: {role.name}'s element encode"
        assert slots[f"k{camel(name)}{camel(role.name)}"] == role.buffer, f"{name}.cu: {role.name}'s Q8Slot"
    assert "streams.at(kWeights, i)" in source and numbers["kWeights"] == algorithm.roles[0].buffer


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_cuda_q8_template_arguments_follow_the_table(name):
    """The CuPy adapter instantiates each q8 moment as ``Q8<signed, ...>`` with its states' map
    (one template argument per plan field: Adam's exp_avg_sq and max_exp_avg_sq share one)."""
    from bf16opt.backends.cupy import kernel_configs
    from bf16opt.storage import Q8, q8_signed

    algorithm = ALGORITHMS[name]
    for kernel, config in kernel_configs(name).items():
        used = {role.storage for _, role, _, _ in config.present()}
        expected = []
        for field in algorithm.storage_parameters:
            if field in used and getattr(config.plan, field) == Q8:
                signs = {q8_signed(role.name) for role in algorithm.moment_roles if role.storage == field}
                assert len(signs) == 1
                expected.append("true" if signs.pop() else "false")
        assert re.findall(r"bf16opt::Q8<(true|false),", kernel) == expected, kernel
