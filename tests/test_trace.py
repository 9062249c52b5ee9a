"""The trace reader behind the overlap GPU test and benchmark, on hand-written Chrome traces."""

from weavepass.testing.trace import stream_overlap


def _kernel(name, stream, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_comm_overlapped_by_compute_on_another_stream():
    trace = {"traceEvents": [
        _kernel("ampere_bf16_gemm", 7, 0, 100),
        _kernel("fused_allreduce_rmsnorm_kernel", 20, 50, 100),  # 50 of its 100 us overlap the gemm
        _kernel("triton_poi_fused_add", 7, 120, 10),  # another 10 us
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # not a kernel
    ]}
    result = stream_overlap(trace)
    assert result.comm_us == 100 and result.comm_overlapped_us == 60
    assert result.overlap_fraction == 0.6
    assert result.comm_streams == {20} and result.compute_streams == {7}
    assert result.compute_us == 110 and result.busy_us == 150
    assert result.top[0][2] == "fused_allreduce_rmsnorm_kernel"
    assert result.host_ops == {}  # aten::mm is not a weave op


def test_host_cost_of_weave_ops_is_summed_per_op():
    def cpu_op(name, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": 0, "dur": dur}

    trace = {"traceEvents": [
        cpu_op("weave::fused_allreduce_rmsnorm_async", 40), cpu_op("weave::fused_allreduce_rmsnorm_async", 60),
        cpu_op("weave::fused_allreduce_rmsnorm", 30), cpu_op("aten::empty", 5),
    ]}
    result = stream_overlap(trace)
    assert result.host_ops == {
        "weave::fused_allreduce_rmsnorm_async": (100.0, 2), "weave::fused_allreduce_rmsnorm": (30.0, 1)
    }
    assert "weave::fused_allreduce_rmsnorm_async: 2x 50.0 us" in result.summary()


def test_same_stream_is_never_overlap():
    trace = {"traceEvents": [
        _kernel("gemm", 7, 0, 100),
        _kernel("fused_allreduce_rmsnorm_kernel", 7, 100, 50),
        _kernel("gemm", 7, 150, 100),
    ]}
    result = stream_overlap(trace)
    assert result.comm_us == 50 and result.comm_overlapped_us == 0 and result.overlap_fraction == 0
    assert result.busy_us == 250
