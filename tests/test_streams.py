"""The split's fork/join bookkeeping (``weavepass.runtime.streams``) on CPU, with CUDA's stream and
event calls replaced by fakes that keep CUDA's rules: an event records only on the device it was
first recorded on (``c10::cuda::CUDAEvent::record``), and every device's default stream has the raw
handle 0. The GPU tests (tests/gpu) run the real thing on one device per process; these cover a
process that drives two devices.
"""

from __future__ import annotations

import pytest
import torch

from weavepass.runtime import streams


class FakeStream:
    def __init__(self, device: int, raw: int, name: str):
        self.device_index, self.raw, self.name = device, raw, name
        self.waited: list[tuple[FakeStream, int]] = []  # (where the event was recorded, its device)

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append((event.last, event.device))  # what a wait uses: the event as recorded now

    def __eq__(self, other):
        return isinstance(other, FakeStream) and (self.device_index, self.raw) == (other.device_index, other.raw)

    def __hash__(self):
        return hash((self.device_index, self.raw))

    def __repr__(self):
        return self.name


class FakeEvent:
    def __init__(self):
        self.device = None
        self.last: FakeStream | None = None
        self.done = False  # what query() answers: the recorded work has finished

    def query(self) -> bool:
        return self.done

    def record(self, stream: FakeStream) -> None:
        if self.device is None:
            self.device = stream.device_index
        if self.device != stream.device_index:  # CUDAEvent::record's check
            raise RuntimeError(f"Event device {self.device} does not match recording stream's device "
                               f"{stream.device_index}.")
        self.last = stream


class FakeOutput:
    """An output tensor as the join sees it: a device, an address and a size."""

    def __init__(self, device: int, address: int):
        self.device = torch.device("cuda", device)
        self._address = address

    def numel(self) -> int:
        return 1

    def data_ptr(self) -> int:
        return self._address


@pytest.fixture
def two_devices(monkeypatch):
    """Two fake devices whose current stream is the default one (raw handle 0 on both)."""
    current = {0: FakeStream(0, 0, "default:0"), 1: FakeStream(1, 0, "default:1")}
    sides = {}
    addresses = iter(range(0x1000, 0x100000, 0x100))

    def lowering(partial, *args, **kwargs):
        device = partial.device.index
        return FakeOutput(device, next(addresses)), FakeOutput(device, next(addresses))

    def stream(device, priority=0):
        sides[device] = FakeStream(device, 100 + device, f"comm:{device}")
        return sides[device]

    stream.priority_range = lambda: (0, -1)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: current[index].raw, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: current[index])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(s.device_index, s))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(streams, "get_lowering", lambda name: lowering)
    monkeypatch.setattr(streams, "_record", lambda event, stream: event.record(stream))
    monkeypatch.setattr(streams, "_wait", lambda event, stream: stream.wait_event(event))
    for state in ("_COMM_STREAMS", "_STREAMS", "_EVENTS", "_PENDING"):  # this process's real ones stay
        monkeypatch.setattr(streams, state, type(getattr(streams, state))())
    yield current, sides


def test_fork_and_join_on_two_devices_of_one_process(two_devices):
    """An async op and its join on device 0, then on device 1: each device's fork and done events
    are recorded on that device's streams, and each join makes that device's current stream wait.
    Keyed by raw handle alone, device 1's current stream was device 0's default stream (handle 0
    on both), and one event pool for all devices handed device 1 an event of device 0, which CUDA
    refuses to record."""
    current, sides = two_devices
    defaults = dict(current)
    for device in (0, 1):
        partial = FakeOutput(device, 0x10 + device)
        normed, residual_out = streams.fused_allreduce_rmsnorm_async(
            partial, None, None, 1e-6, "0", torch.float32, "fake", 16, 0)
        assert current[device] is defaults[device]  # the op gave the caller its stream back
        assert sides[device].waited == [(defaults[device], device)]  # fork: after this device's work
        streams.join_async(normed, residual_out, [partial])
        assert defaults[device].waited == [(sides[device], device)]  # join: this device waits for the op
    assert not streams._PENDING


def test_joins_left_by_failed_runs_are_swept(two_devices):
    """A graph that raises between an async op and its join leaves the join pending, holding the
    op's inputs. Past ``_SWEEP_ABOVE`` pending joins, the next op drops the fused ops' joins whose
    kernels are done, and keeps those still running and every push join (whose join launches the
    reduce)."""
    stale = {}
    for i in range(streams._SWEEP_ABOVE):
        event = FakeEvent()
        event.done = True
        stale[0x900000 + i] = streams._Join(event, (object(),))
    running = streams._Join(FakeEvent(), (object(),))
    push = streams._PushJoin(FakeEvent(), None, None, ())
    push.event.done = True
    streams._PENDING.update(stale)
    streams._PENDING[0x800000] = running
    streams._PENDING[0x800100] = push
    partial = FakeOutput(0, 0x10)
    normed, _ = streams.fused_allreduce_rmsnorm_async(partial, None, None, 1e-6, "0", torch.float32, "fake", 16, 0)
    assert set(streams._PENDING) == {0x800000, 0x800100, normed.data_ptr()}
    assert streams._PENDING[0x800000] is running and streams._PENDING[0x800100] is push


def test_no_sweep_below_the_threshold(two_devices):
    """Normal runs keep a few joins pending: nothing is dropped, done or not."""
    event = FakeEvent()
    event.done = True
    streams._PENDING[0x800000] = done = streams._Join(event, (object(),))
    partial = FakeOutput(0, 0x10)
    normed, _ = streams.fused_allreduce_rmsnorm_async(partial, None, None, 1e-6, "0", torch.float32, "fake", 16, 0)
    assert streams._PENDING[0x800000] is done and normed.data_ptr() in streams._PENDING


@pytest.mark.parametrize("lowering", ["cuda_symm", "portable"])
def test_the_cuda_lowering_gets_the_stream_others_run_with_it_current(two_devices, monkeypatch, lowering):
    """``cuda_symm`` is handed the communication stream (``stream=``) and runs while the caller's
    stream stays current (its outputs come from the caller's pool); any other lowering runs with
    the communication stream current and gets no ``stream``. Either way the fork precedes the call,
    the done event is recorded on the communication stream, the caller gets its stream back, and
    the pending join holds the inputs and both outputs."""
    current, sides = two_devices
    default = current[0]
    seen = {}
    addresses = iter(range(0x5000, 0x6000, 0x100))

    def recording_lowering(partial, *args, **kwargs):
        seen["current"] = current[0]
        seen["stream"] = kwargs.get("stream")
        seen["side_waited"] = list(sides[0].waited)
        return FakeOutput(0, next(addresses)), FakeOutput(0, next(addresses))

    monkeypatch.setattr(streams, "get_lowering", lambda name: recording_lowering)
    partial = FakeOutput(0, 0x10)
    normed, residual_out = streams.fused_allreduce_rmsnorm_async(
        partial, None, None, 1e-6, "0", torch.float32, lowering, 16, 0)
    side = sides[0]
    assert seen["side_waited"] == [(default, 0)]  # forked before the lowering ran
    if lowering == "cuda_symm":
        assert seen["stream"] is side and seen["current"] is default
    else:
        assert seen["stream"] is None and seen["current"] is side
    assert current[0] is default
    entry = streams._PENDING[normed.data_ptr()]
    assert entry.event.last is side
    assert entry.keep[0] is partial and entry.keep[-2:] == (normed, residual_out)
    streams.join_async(normed, residual_out, [partial])
    assert default.waited == [(side, 0)] and not streams._PENDING


def test_the_layer_norm_async_op_hands_the_stream_to_the_cuda_lowering(two_devices, monkeypatch):
    """The LayerNorm form reaches ``fused_allreduce_rmsnorm_cuda`` through two more functions
    (``runtime.fused_allreduce_layernorm``, ``dispatch.fused_allreduce_layernorm_cuda``): the
    communication stream and the grid arrive as the lowering's ``stream`` and a launch override,
    with ``layer_norm`` and the bias, and the caller's stream stays current."""
    from weavepass.runtime.cuda import dispatch

    current, sides = two_devices
    default = current[0]
    seen = {}

    def cuda_lowering(partial, residual, weight, eps, group_name, out_dtype, **kwargs):
        seen.update(kwargs, current=current[0])
        return FakeOutput(0, 0x7000), FakeOutput(0, 0x7100)

    monkeypatch.setattr(dispatch, "fused_allreduce_rmsnorm_cuda", cuda_lowering)
    partial, bias = FakeOutput(0, 0x10), object()
    normed, residual_out = streams.fused_allreduce_layernorm_async(
        partial, None, None, bias, 1e-6, "0", torch.float32, "cuda_symm", 16, 4)
    assert seen["stream"] is sides[0] and seen["current"] is default and current[0] is default
    assert seen["layer_norm"] is True and seen["bias"] is bias
    assert seen["num_ctas"] == 4 and seen["max_workspace_tokens"] == 16
    assert streams._PENDING[normed.data_ptr()].keep[3] is bias
    streams.join_async(normed, residual_out, [partial])
    assert not streams._PENDING
