"""Numba steps in forked processes: a multiprocessing child and a DataLoader worker (a step
with its state beside the param and an offloaded one, whose update thread the child makes anew).

A training script steps a CPU model with ``backend="numba"`` and then forks: a
``multiprocessing`` child (start method "fork") or a ``torch.utils.data.DataLoader`` worker
(``num_workers=1``, fork).  The child builds its own optimizer and steps with the Numba
backend; it must finish (no crash, no hang: ``CHILD_TIMEOUT``) and produce the bits the
parent computes for the same inputs.

Also: a child forked while another parent thread is inside a Numba step (it holds the
backend's kernel lock, which the child inherits held).

Each scenario runs in a fresh interpreter (``PROBE``), so that what the parent did before the
fork is exactly the scenario's (this pytest process has run other Numba tests), once with the
environment's threading layer (GNU OpenMP on the development machine: Numba's ``omp`` layer
when TBB is missing, which is not fork-safe) and once with ``NUMBA_THREADING_LAYER=workqueue``.
The multiprocessing child calls ``torch.set_num_threads(1)`` first, as DataLoader workers do:
torch's own parallel ops hang in a forked child otherwise, whatever bf16opt does.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD_TIMEOUT = 60  # seconds a child may take before it counts as hung
ROOT = Path(__file__).resolve().parent.parent

PROBE = r'''
import hashlib, json, multiprocessing, sys
import numba, torch
import bf16opt

TIMEOUT = float(sys.argv[1])


def digest_of_a_run():
    """Three bf16-sr AdamW steps on a param of 3 chunks (so the kernel runs on several threads),
    with its state beside it and offloaded (the offload pipeline's update thread, 3 chunks)."""
    digest = hashlib.sha256()
    for offload in (None, "cpu"):
        generator = torch.Generator().manual_seed(0)
        param = torch.nn.Parameter(torch.randn(70001, generator=generator).to(torch.bfloat16))
        grads = [torch.randn(70001, generator=generator).to(torch.bfloat16) for _ in range(3)]
        opt = bf16opt.AdamW([param], lr=1e-2, precision="bf16-sr", backend="numba", seed=7, offload=offload)
        if offload:
            opt._offloader.chunk_elements = 1 << 15
        for grad in grads:
            param.grad = grad
            opt.step()
        for tensor in [param.detach()] + [opt.state[param][key] for key in sorted(opt.state[param])]:
            digest.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def child(writer):
    # torch's own intra-op pool (GNU OpenMP) deadlocks in a forked child once the parent has used
    # it (here: the .to(bfloat16) of 70001 elements); DataLoader workers set one thread for that
    # reason, and so does this child: what is tested is bf16opt's Numba step, not torch's ops
    torch.set_num_threads(1)
    try:
        writer.send(("ok", digest_of_a_run()))
    except BaseException as error:  # report, do not hide
        writer.send(("error", repr(error)))
    finally:
        writer.close()


class OneRun(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, index):
        return digest_of_a_run()


# the parent: a Numba step on a CPU model, as a training script would do before forking
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
opt = bf16opt.AdamW(model.parameters(), lr=1e-3, backend="numba")
model(torch.randn(32, 64)).pow(2).mean().backward()
opt.step()
expected = digest_of_a_run()
result = {"layer": numba.threading_layer()}
if result["layer"] == "omp":
    from numba.np.ufunc import omppool
    result["vendor"] = omppool.openmp_vendor

context = multiprocessing.get_context("fork")


def fork_child():
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=child, args=(writer,))
    process.start()
    writer.close()
    if reader.poll(TIMEOUT):
        try:
            status, value = reader.recv()
        except EOFError:
            status, value = "died", None
    else:
        status, value = "hung", None
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
    return {"status": status, "value": value, "exitcode": process.exitcode, "same": value == expected}


result["fork"] = fork_child()

# fork while another parent thread is inside a Numba step (holds the backend's kernel lock):
# the child inherits the lock held, by a thread that does not exist in the child
from bf16opt.backends import numba as numba_backend
lock = getattr(numba_backend, "_KERNEL_LOCK", None)
if lock is None:
    result["fork_lock_held"] = {"status": "n/a"}
else:
    import threading
    holding, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            holding.set()
            release.wait()
    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait()
    result["fork_lock_held"] = fork_child()
    release.set()
    holder.join()


loader = torch.utils.data.DataLoader(OneRun(), batch_size=None, num_workers=1, multiprocessing_context="fork",
                                     timeout=TIMEOUT)
try:
    [value] = list(loader)
    result["dataloader"] = {"status": "ok", "value": value, "same": value == expected}
except Exception as error:
    result["dataloader"] = {"status": "error", "value": repr(error), "same": False}
print("RESULT:" + json.dumps(result), flush=True)
'''


LAYERS = (None, "workqueue")  # None: the environment's own threading layer


@functools.lru_cache(maxsize=None)
def _probes() -> dict:
    """Both probes, started together (each is mostly interpreter start-up and kernel loading)."""
    probes = {}
    for layer in LAYERS:
        env = dict(os.environ)
        if layer is not None:
            env["NUMBA_THREADING_LAYER"] = layer
        probes[layer] = subprocess.Popen([sys.executable, "-c", PROBE, str(CHILD_TIMEOUT)], cwd=ROOT, env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return probes


@functools.lru_cache(maxsize=None)
def outcome(threading_layer) -> dict:
    """The probe's result in a fresh interpreter (``threading_layer``: NUMBA_THREADING_LAYER, or
    None for the environment's own)."""
    process = _probes()[threading_layer]
    try:
        stdout, stderr = process.communicate(timeout=3 * CHILD_TIMEOUT + 120)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        pytest.fail(f"the probe hung:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT:")]
    assert process.returncode == 0 and lines, \
        f"the probe failed (exit code {process.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}"
    result = json.loads(lines[-1][len("RESULT:"):])
    result["output"] = (stdout + stderr)[-2000:]
    return result


def describe(result: dict, key: str) -> str:
    return f"layer {result['layer']} {result.get('vendor', '')}: {result[key]}\n{result['output']}"


@pytest.fixture(scope="module", autouse=True)
def _no_probe_left_running():
    yield
    for process in _probes().values():
        if process.poll() is None:
            process.kill()
            process.communicate()


ON_LAYERS = pytest.mark.parametrize("layer", LAYERS, ids=["default-layer", "workqueue"])


@ON_LAYERS
def test_forked_child_steps_with_numba(layer):
    result = outcome(layer)
    assert layer is None or result["layer"] == layer
    assert result["fork"]["status"] == "ok" and result["fork"]["exitcode"] == 0, describe(result, "fork")
    assert result["fork"]["same"], describe(result, "fork")


@ON_LAYERS
def test_forked_dataloader_worker_steps_with_numba(layer):
    result = outcome(layer)
    assert result["dataloader"]["status"] == "ok", describe(result, "dataloader")
    assert result["dataloader"]["same"], describe(result, "dataloader")


@ON_LAYERS
def test_child_forked_while_a_parent_thread_steps(layer):
    result = outcome(layer)
    if result["fork_lock_held"]["status"] == "n/a":
        pytest.skip("bf16opt.backends.numba has no _KERNEL_LOCK any more: nothing to hold")
    assert result["fork_lock_held"]["status"] == "ok", describe(result, "fork_lock_held")
    assert result["fork_lock_held"]["same"], describe(result, "fork_lock_held")


RELEASE_CHILD = r'''
import faulthandler, os, sys
import torch, bf16opt

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(torch.bfloat16)
opt = bf16opt.AdamW(model.parameters(), offload="cpu", update_in_backward=True)
x = torch.randn(4, 16, dtype=torch.bfloat16)


def train():
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


train()
train()
pid = os.fork()
if pid == 0:
    torch.set_num_threads(1)  # (torch's own OpenMP pool is not fork-safe; DataLoader workers do this)
    faulthandler.dump_traceback_later(float(sys.argv[1]), exit=True)  # a hang exits 1, with a traceback
    train()
    train()
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
'''


def test_a_fork_child_updates_offloaded_params_in_backward():
    """The thread of the offloaded updates in backward does not survive a fork: the child's
    optimizer starts its own rather than waiting for the parent's at the end of backward."""
    process = subprocess.run([sys.executable, "-c", RELEASE_CHILD, str(CHILD_TIMEOUT / 2)],
                             capture_output=True, text=True, timeout=CHILD_TIMEOUT * 2,
                             env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    assert process.returncode == 0, process.stderr[-3000:]


TORCH_THREADS_CHILD = r'''
import torch, bf16opt
torch.set_num_threads(2)
param = torch.nn.Parameter(torch.randn(100000))
opt = bf16opt.AdamW([param], backend="numba")
param.grad = torch.randn(100000)
opt.step()
print(torch.get_num_threads())
'''


def test_the_first_numba_step_leaves_torchs_thread_count():
    """Numba's OpenMP layer sets the OpenMP thread count to NUMBA_NUM_THREADS as its pool
    starts; with a lower NUMBA_NUM_THREADS that was torch's intra-op count from then on."""
    process = subprocess.run([sys.executable, "-c", TORCH_THREADS_CHILD], capture_output=True, text=True,
                             timeout=CHILD_TIMEOUT * 2, env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.split() == ["2"]
