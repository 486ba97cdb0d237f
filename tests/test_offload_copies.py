"""Copy engines of CPU offload (bf16opt.offload_copies): exact copies, throttling, out-of-order
completion, error propagation, thread shutdown and host-buffer accounting.

The CUDA engine runs for real only with a CUDA device; without one its control flow (stream waits,
events, record_stream, publish) is still exercised against a fake torch.cuda runtime on CPU tensors.
"""

import contextlib
import gc
import threading
import time
import warnings

import pytest
import torch

from bf16opt.offload_copies import (CopyEngine, CudaCopyEngine, HostBytes, ImmediateCopyEngine,
                                    ThreadedCopyEngine, Transfer, engine_for)

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int16]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def random_bits(shape, dtype, seed=0):
    """A tensor whose bit patterns are uniformly random (NaN payloads, subnormals, -0 included)."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(-(2 ** 15), 2 ** 15, shape, generator=g, dtype=torch.int32)
    if size == 4:
        raw = raw * 65537 + torch.randint(0, 2 ** 15, shape, generator=g, dtype=torch.int32)
    return raw.to(BITS[size]).view(dtype)


def bits(t):
    return t.cpu().contiguous().view(BITS[t.element_size()])


def threads_named(prefix):
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def engine_threads(engine):
    return threads_named(engine._threads[0].name.rsplit("-", 2)[0] + "-")


ENGINES = {
    "immediate": lambda: ImmediateCopyEngine(),
    "threaded": lambda: ThreadedCopyEngine(),
    "threaded-jitter": lambda: ThreadedCopyEngine(jitter=0.002, seed=1),
    "cuda": lambda: CudaCopyEngine("cuda"),
}


@pytest.fixture(params=[pytest.param(k, marks=needs_cuda if k == "cuda" else ()) for k in ENGINES])
def engine(request):
    eng = ENGINES[request.param]()
    yield eng
    eng.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "transposed"])
def test_round_trip_is_bit_exact(engine, dtype, layout):
    dev = engine.device
    base = random_bits((24, 40), dtype, seed=DTYPES.index(dtype)).to(dev)
    param = torch.zeros(24, 40, dtype=dtype, device=dev)
    view = {"contiguous": lambda t: t, "strided": lambda t: t[:, ::2],
            "transposed": lambda t: t.t()}[layout]
    src = view(base)
    host = engine.host_empty(src.shape, dtype)
    assert host.device.type == "cpu"
    down = engine.to_host(host, src)  # device -> host, possibly non-contiguous source
    down.wait()
    assert down.done()
    assert torch.equal(bits(host), bits(src))
    up = engine.to_device(view(param), host)  # host -> a (possibly non-contiguous) view of a param
    engine.publish([up])
    assert torch.equal(bits(view(param)), bits(src))
    host2 = engine.host_empty(src.shape, dtype)
    engine.to_host(host2, view(param))
    back = torch.empty(src.shape, dtype=dtype, device=dev)
    engine.to_device(back, host)  # non-contiguous host source and contiguous destination
    engine.synchronize()
    assert torch.equal(bits(host2), bits(src)) and torch.equal(bits(back), bits(src))


def test_shape_dtype_and_device_are_checked_when_starting():
    with ThreadedCopyEngine() as eng:
        for e in (ImmediateCopyEngine(), eng):
            with pytest.raises(ValueError, match="shapes and dtypes"):
                e.to_host(torch.empty(3), torch.empty(4))
            with pytest.raises(ValueError, match="shapes and dtypes"):
                e.to_device(torch.empty(4), torch.empty(4, dtype=torch.bfloat16))
            with pytest.raises(ValueError, match="must be on"):
                e.to_device(torch.empty(4, device="meta"), torch.empty(4))
            with pytest.raises(TypeError):
                e.to_host([0.0], torch.empty(1))


def test_threaded_bandwidth_and_latency_throttle():
    with ThreadedCopyEngine(bandwidth=100e6) as eng:  # 4 MiB at 100 MB/s: >= 41.9 ms
        src, dst = torch.ones(1 << 20), torch.empty(1 << 20)
        start = time.perf_counter()
        t = eng.to_device(dst, src)
        t.wait()
        assert time.perf_counter() - start >= 0.04
        assert torch.equal(dst, src)
    with ThreadedCopyEngine(bandwidth=100e6, workers=2) as eng:  # bandwidth is shared by workers
        start = time.perf_counter()
        ts = [eng.to_host(torch.empty(1 << 19), torch.ones(1 << 19)) for _ in range(2)]
        eng.publish(ts)
        assert time.perf_counter() - start >= 0.04
    with ThreadedCopyEngine(latency=0.03) as eng:
        start = time.perf_counter()
        eng.to_host(torch.empty(1), torch.ones(1)).wait()
        assert time.perf_counter() - start >= 0.03


def completion_observations(transfers, timeout=5.0):
    """Poll the transfers; return the list of done-sets seen until all are done."""
    seen, deadline = [], time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        done = frozenset(i for i, t in enumerate(transfers) if t.done())
        if not seen or seen[-1] != done:
            seen.append(done)
        if len(done) == len(transfers):
            return seen
        time.sleep(0.0002)
    raise AssertionError("transfers did not finish")


def is_prefix(done):
    return done == frozenset(range(len(done)))


def test_fifo_without_jitter():
    with ThreadedCopyEngine(latency=0.001) as eng:
        ts = [eng.to_host(torch.empty(8), torch.full((8,), float(i))) for i in range(12)]
        assert all(is_prefix(done) for done in completion_observations(ts))


def test_jitter_completes_out_of_order():
    out_of_order = False
    for seed in range(4):
        with ThreadedCopyEngine(jitter=0.01, seed=seed) as eng:
            dsts = [torch.zeros(8) for _ in range(12)]
            ts = [eng.to_device(d, torch.full((8,), i + 1.0)) for i, d in enumerate(dsts)]
            out_of_order |= not all(is_prefix(done) for done in completion_observations(ts))
            eng.publish(ts)
            assert all(torch.equal(d, torch.full((8,), i + 1.0)) for i, d in enumerate(dsts))
        if out_of_order:
            break
    assert out_of_order


def test_synchronize_covers_many_copies():
    with ThreadedCopyEngine(jitter=0.0005, seed=2) as eng:
        dsts = [torch.zeros(4) for _ in range(300)]
        ts = [eng.to_device(d, torch.full((4,), float(i))) for i, d in enumerate(dsts)]
        eng.synchronize()
        assert all(t.done() for t in ts)
        assert all(torch.equal(d, torch.full((4,), float(i))) for i, d in enumerate(dsts))


def test_jitter_lands_data_late():
    with ThreadedCopyEngine(jitter=0.05, seed=0) as eng:  # first delay: 42 ms
        dst = torch.zeros(8)
        t = eng.to_device(dst, torch.ones(8))
        assert not t.done() and not dst.any()  # a consumer that does not wait reads stale data
        t.wait()
        assert torch.equal(dst, torch.ones(8))


def test_jitter_delays_are_seeded():
    def delays(seed):
        with ThreadedCopyEngine(jitter=0.001, seed=seed) as eng:
            ts = [eng.to_host(torch.empty(1), torch.ones(1)) for _ in range(5)]
            eng.synchronize()
            return [t.delay for t in ts]
    assert delays(3) == delays(3) != delays(4)


def test_errors_propagate_through_wait_publish_and_synchronize():
    with ThreadedCopyEngine() as eng:
        bad = eng.to_device(torch.zeros(1).expand(4), torch.ones(4))  # overlapping dst: copy_ raises
        with pytest.raises(RuntimeError, match="memory location"):
            bad.wait()
        assert bad.done()
        with pytest.raises(RuntimeError, match="memory location"):
            bad.wait()  # every wait re-raises
        good = eng.to_host(torch.empty(4), torch.ones(4))
        with pytest.raises(RuntimeError, match="memory location"):
            eng.publish([bad, good])
        assert good.done()
        with pytest.raises(RuntimeError, match="memory location"):
            eng.synchronize()
        eng.synchronize()  # reported once
        dst = torch.empty(4)
        eng.to_host(dst, torch.full((4,), 2.0)).wait()  # the engine keeps working
        assert torch.equal(dst, torch.full((4,), 2.0))
    with pytest.raises(RuntimeError, match="memory location"):
        ImmediateCopyEngine().to_device(torch.zeros(1).expand(4), torch.ones(4))


def test_close_finishes_pending_copies_and_ends_threads():
    eng = ThreadedCopyEngine(latency=0.02, jitter=0.005)
    assert len(engine_threads(eng)) == 8 and all(t.daemon for t in eng._threads)
    dst = torch.zeros(4)
    t = eng.to_device(dst, torch.ones(4))
    eng.close()
    assert t.done() and torch.equal(dst, torch.ones(4))
    assert not any(th.is_alive() for th in eng._threads)
    eng.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        eng.to_host(torch.empty(1), torch.ones(1))


def test_threads_end_when_engine_is_garbage_collected():
    eng = ThreadedCopyEngine(latency=0.01)
    threads = list(eng._threads)
    assert threads == engine_threads(eng)
    dst = torch.zeros(4)
    t = eng.to_host(dst, torch.ones(4))
    del eng
    gc.collect()
    for th in threads:
        th.join(timeout=5)
        assert not th.is_alive()
    assert t.done() and torch.equal(dst, torch.ones(4))


@pytest.mark.parametrize("make", [ImmediateCopyEngine, ThreadedCopyEngine])
def test_host_bytes_tracks_live_buffers(make):
    with make() as eng:  # storages are freed by reference counting, no gc needed
        assert eng.host_bytes() == HostBytes(0, 0)
        a = eng.host_empty((1000,), torch.float32)
        b = eng.host_empty((10, 10), torch.bfloat16)
        assert eng.host_bytes() == HostBytes(pinned=0, pageable=4200) and eng.host_bytes().total == 4200
        view = a[::2]
        del a
        assert eng.host_bytes().pageable == 4200  # a view keeps the storage alive
        del view
        assert eng.host_bytes() == HostBytes(0, 200)
        del b
        assert eng.host_bytes() == HostBytes(0, 0)


def test_pinning_failure_falls_back_to_pageable(monkeypatch):
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("cudaHostAlloc failed")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    eng = ImmediateCopyEngine()
    eng.pinned = True  # as a CUDA engine starts; the fallback lives in the shared host_empty
    with pytest.warns(RuntimeWarning, match="pageable"):
        buf = eng.host_empty((16,), torch.float16)
    assert not eng.pinned and eng.host_bytes() == HostBytes(0, 32)
    eng.host_empty((16,), torch.float16)  # no further attempt, no further warning
    del buf


def test_engine_for_and_constructors_without_a_device():
    assert type(engine_for(torch.device("cpu"))) is ImmediateCopyEngine
    assert type(engine_for("cpu")) is ImmediateCopyEngine
    with engine_for("cpu", bandwidth=25e9) as eng:
        assert type(eng) is ThreadedCopyEngine and isinstance(eng, CopyEngine) and not eng.pinned
    for cls in (ImmediateCopyEngine, ThreadedCopyEngine):
        with pytest.raises(ValueError, match="CPU params"):
            cls("meta")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        CudaCopyEngine("cpu")
    with pytest.raises(ValueError, match="no copy engine"):
        engine_for("meta")
    with pytest.raises(ValueError):
        ThreadedCopyEngine(bandwidth=0)
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            engine_for("cuda")
    assert Transfer().done() and Transfer().wait() is None


class FakeRuntime:
    """Stands in for torch.cuda: streams, events and record_stream log what the engine asks for."""

    def __init__(self, monkeypatch):
        self.log, self.active = [], None
        runtime, names = self, iter(["d2h", "h2d"])

        class Stream:
            def __init__(self, device=None, name=None):
                self.name = name or next(names)

            def wait_stream(self, other):
                runtime.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event):
                runtime.log.append(("wait_event", self.name, event.id))

            def synchronize(self):
                runtime.log.append(("synchronize", self.name))

        class Event:
            count = 0

            def __init__(self):
                self.id, Event.count = Event.count, Event.count + 1

            def record(self, stream):
                runtime.log.append(("record", self.id, stream.name))

            def query(self):
                return True

            def synchronize(self):
                runtime.log.append(("event_sync", self.id))

        @contextlib.contextmanager
        def stream(s):
            runtime.active = s.name
            yield
            runtime.active = None

        real_copy = torch.Tensor.copy_

        def copy_(self, src, non_blocking=False):
            runtime.log.append(("copy", runtime.active, non_blocking))
            return real_copy(self, src)

        self.current = Stream(name="current")
        for name, value in {"is_available": lambda: True, "current_device": lambda: 0, "Stream": Stream,
                            "Event": Event, "stream": stream,
                            "current_stream": lambda device=None: self.current}.items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, s: runtime.log.append(("record_stream", s.name, t.data_ptr())))


def test_cuda_engine_control_flow_with_fake_runtime(monkeypatch):
    fake = FakeRuntime(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pinning fails on a CPU-only torch build
        eng = engine_for("cuda")
    assert type(eng) is CudaCopyEngine and eng.device == torch.device("cuda", 0)
    eng.device = torch.device("cpu")  # let CPU tensors pass the device checks
    grad, host = torch.arange(6.0).view(2, 3).t(), torch.empty(3, 2)
    fake.log.clear()
    t0 = eng.to_host(host, grad)
    assert fake.log == [("wait_stream", "d2h", "current"), ("copy", "d2h", True), ("record", 0, "d2h"),
                        ("record_stream", "d2h", grad.data_ptr())]
    assert torch.equal(host, grad) and t0.done() and t0._keep is None
    t1 = eng.to_host(torch.empty(3, 2), grad)
    param = torch.zeros(3, 2)
    fake.log.clear()
    t2 = eng.to_device(param, host)
    assert fake.log == [("wait_stream", "h2d", "current"), ("copy", "h2d", True), ("record", 2, "h2d"),
                        ("record_stream", "h2d", param.data_ptr())]
    fake.log.clear()
    eng.publish([t2, t1, t0])  # the current stream waits on the last event of each side stream
    assert sorted(fake.log) == [("wait_event", "current", 1), ("wait_event", "current", 2)]
    fake.log.clear()
    t2.wait()
    eng.synchronize()
    assert fake.log == [("event_sync", 2), ("synchronize", "d2h"), ("synchronize", "h2d")]


@needs_cuda
def test_cuda_copies_are_ordered_after_the_producer_and_before_consumers():
    eng = CudaCopyEngine("cuda")
    dev = eng.device
    a = torch.randn(2048, 2048, device=dev)
    host = eng.host_empty(a.shape, a.dtype)
    assert eng.host_bytes().pinned == a.numel() * 4 or not eng.pinned
    grad = a @ a @ a  # slow producer on the current stream
    t = eng.to_host(host, grad)
    t.wait()
    assert torch.equal(host, grad.cpu())
    param = torch.zeros_like(a)
    up = eng.to_device(param, host)
    eng.publish([up])
    assert torch.equal((param * 1).cpu(), host)  # queued after publish: sees the new values
    del grad
    eng.synchronize()
