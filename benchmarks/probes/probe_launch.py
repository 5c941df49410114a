"""Where a prepared launch's host time goes (one GPU): the pieces of Launch.__call__ timed alone.
For tuning kernels/_launch.py's replay path; prints µs, no file.
H200: bash scripts/device/run_h200.sh bench benchmarks/probes/probe_launch.py"""
import math, statistics, time, torch, triton
from dcp_plugin.kernels import _launch, plan_write_kv
def t(fn, n=300):
    fn(); torch.cuda.synchronize(); xs = []
    for _ in range(n):
        a = time.perf_counter(); fn(); xs.append(time.perf_counter() - a)
    torch.cuda.synchronize(); return round(statistics.median(xs) * 1e6, 2)
k = torch.randn(32, 1, 128, device="cuda", dtype=torch.bfloat16)
kv = torch.randn(64, 16, 1, 256, device="cuda", dtype=torch.bfloat16)
slots = torch.full((32,), -1, device="cuda")
args = (k, k, kv[..., :128], kv[..., 128:], slots)
L = plan_write_kv(*args)  # the write's prepared Launch
args = (*args, slots, slots)  # the scale arguments' stand-ins, as the write's Launch substitutes them
L(*args)
c = L._compiled
print("triton", triton.__version__, "FAST", _launch.FAST_LAUNCH, "compiled kept", c is not None)
print("Launch call", t(lambda: L(*args)))
print("alignment", t(lambda: _launch._alignment([a.data_ptr() for a in args])))
print("gcd", t(lambda: math.gcd(*[a.data_ptr() for a in args]) % 16))
print("knobs hook", t(lambda: triton.knobs.runtime.launch_enter_hook))
print("stream", t(lambda: _launch._current_stream(0)))
if c is not None:
    s = _launch._current_stream(0)
    print("c.run direct", t(lambda: c.run(*L.grid, s, c.function, c.packed_metadata, None, None, None, *args, *L._tail)))
    ptrs = [a.data_ptr() for a in args]
    print("c.run ints", t(lambda: c.run(*L.grid, s, c.function, c.packed_metadata, None, None, None, *ptrs, *L._tail)))
    print("c.run attr", t(lambda: c.run))
print("jit dispatch", t(lambda: L.kernel[L.grid](*args, *L.scalars, **L.constexprs, **L.options)))
print("torch add", t(lambda: k.add_(0)))
print("hook", triton.knobs.runtime.launch_enter_hook, "aligned", L._aligned, _launch._alignment([a.data_ptr() for a in args]), "dev", L._device)
import inspect; print(inspect.getsource(type(L).__call__)[:900])
