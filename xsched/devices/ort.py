"""ONNX Runtime devices: one plugin per execution provider ('ort:cpu', 'ort:cpu:1', 'ort:cuda:0').

Profiling runs each node alone, in a single-node session with graph optimisations off (so a node stays one
node), its inputs bound on the device with IOBinding (so no host copy is timed as compute). Copies are OrtValue
transfers, timed as the placed executor makes them. The same plugin builds the sessions that executor runs.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.onnx_ops import ALIAS_OPS, FORMAT, example_array, op_model, op_type, static_array
from xsched.devices.base import (
    DEFAULT_POLICY,
    Device,
    DeviceError,
    DeviceInfoRow,
    Measurement,
    Policy,
    parse_options,
    perf_clock,
    relative_spread,
    repeat_until_stable,
)
from xsched.devices.cpu import DEFAULT_POWER, SWEEP_BYTES, _enough, cpu_model, host_memory_bytes, thread_clock
from xsched.devices.energy import modelled_energy, nvml_gpus, rapl

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
OPTIMIZATION = {
    "disabled": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


def onnxruntime(device: str | None = None) -> Any:
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise DeviceError(f"onnxruntime is not installed: pip install 'xsched[onnx]' ({e})", device=device) from e
    return ort


class OrtDevice(Device):
    """'ort:cpu' (a logical one: 'ort:cpu:1'), 'ort:cuda' or 'ort:cuda:N'; 'ort:cpu,threads=2' sets the
    session's intra-op threads. A CUDA session may not fall back to the CPU: a node the CUDA provider cannot run
    is reported as such (ONNX Runtime would otherwise move it to the CPU without saying so).

    'ort:cpu,threads=1,clock=thread' times nodes by the calling thread's CPU time (with one intra-op thread ONNX
    Runtime runs the kernels on the caller): what a node costs on a core of its own, whatever else runs."""

    kind = "ort"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        _, _, rest = name.partition(":")
        head, _, more = rest.partition(",")
        where, _, index = head.partition(":")
        if where not in PROVIDERS or (index and not index.isdigit()):
            raise DeviceError(f"an ONNX Runtime device is ort:cpu[:N] or ort:cuda[:N], got {name!r}", device=name)
        self.where = where
        self.index = int(index) if index else None
        self.device_id = (self.index or 0) if where == "cuda" else 0
        opts = parse_options(f"ort:{more}", ["threads", "clock"])
        self.threads: int | None = None
        if "threads" in opts:
            if not opts["threads"].isdigit() or int(opts["threads"]) < 1:
                raise DeviceError(f"threads must be a positive integer, got {opts['threads']!r}", device=name)
            self.threads = int(opts["threads"])
        self.clock = opts.get("clock", "wall")
        if self.clock not in ("wall", "thread") or (self.clock == "thread" and (where, self.threads) != ("cpu", 1)):
            raise DeviceError("clock is wall, or thread on ort:cpu with threads=1 (one thread's CPU time)", device=name)
        self.ort = onnxruntime(name)
        if self.provider not in self.ort.get_available_providers():
            raise DeviceError(
                f"{self.provider} is not available in this onnxruntime {self.ort.__version__} build "
                f"(it has {', '.join(self.ort.get_available_providers())}; for CUDA: pip install "
                "onnxruntime-gpu)",
                device=name,
            )
        from xsched.devices.spec import match_spec

        hardware = cpu_model()["brand"] if where == "cpu" else str(self._gpu().get("name", ""))
        self.spec = match_spec(hardware, "cpu" if where == "cpu" else "gpu")

    # ---- identity ----
    @property
    def provider(self) -> str:
        return PROVIDERS[self.where]

    @property
    def device_type(self) -> str:
        """The device OrtValues live on, as IOBinding and OrtValue name it."""
        return self.where

    @property
    def is_host(self) -> bool:
        return self.where == "cpu"

    @property
    def params_as_initializers(self) -> bool:
        """Params homed here are given to sessions as initializers sharing the home's memory (the CPU provider
        then prepacks and fuses as in a plain session); on a GPU they are bound as inputs, so that no session
        holds a copy of its own that the plan does not count."""
        return self.where == "cpu"

    def _gpu(self) -> dict[str, Any]:
        gpus = nvml_gpus()
        return next((g for g in gpus if g.get("index") == self.device_id), {})

    @property
    def memory_bytes(self) -> int:
        if self.where == "cpu":
            return host_memory_bytes()
        return int(self._gpu().get("memory_bytes") or 0)

    @property
    def description(self) -> str:
        what = cpu_model()["brand"] if self.where == "cpu" else self._gpu().get("name", f"GPU {self.device_id}")
        threads = f", {self.threads} threads" if self.threads else ""
        return f"ONNX Runtime {self.ort.__version__} {self.provider} on {what}{threads}"

    def fingerprint_parts(self) -> dict[str, str]:
        parts = {
            "provider": self.provider,
            "onnxruntime": self.ort.__version__,
            "threads": str(self.threads or 0),
            "clock": self.clock,
        }
        if self.where == "cpu":
            m = cpu_model()
            parts.update(brand=m["brand"], arch=m["arch"], logical_cores=str(m["logical_cores"]))
        else:
            g = self._gpu()
            parts.update(
                name=str(g.get("name", "unknown")),
                memory_bytes=str(g.get("memory_bytes", "unknown")),
                driver=str(g.get("driver", "unknown")),
                cuda=str(getattr(self.ort, "cuda_version", "")),
            )
        return parts

    @property
    def energy_source(self) -> str:
        return "rapl" if self.where == "cpu" and rapl().available else "model"

    @property
    def power(self) -> dict[str, float]:
        if self.spec is not None:
            return self.spec.power
        if self.where == "cpu":
            return DEFAULT_POWER
        limit = self._gpu().get("power_limit_w") or 300.0
        return {"idle_power_w": 0.1 * limit, "max_power_w": limit}

    # ---- sessions and values (shared with the placed executor) ----
    def session(self, model: Any, external: Mapping[str, Any] | None = None, optimization: str = "all") -> Any:
        """An InferenceSession of `model` on this provider alone; `external` (name -> OrtValue) are initializers
        declared in the model (external_initializer) whose memory the session shares."""
        ort = self.ort
        if optimization not in OPTIMIZATION:
            raise DeviceError(f"optimization must be one of {', '.join(OPTIMIZATION)}, got {optimization!r}")
        so = ort.SessionOptions()
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION[optimization])
        so.log_severity_level = 3
        if self.threads:
            so.intra_op_num_threads = self.threads
        if self.where != "cpu":
            so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        if external:
            so.add_external_initializers(list(external), list(external.values()))
        options = {"device_id": str(self.device_id)} if self.where == "cuda" else {}
        return ort.InferenceSession(model.SerializeToString(), so, providers=[(self.provider, options)])

    def put(self, array: Any) -> Any:
        """An OrtValue on this device holding `array` (on the CPU it shares the array's memory)."""
        import numpy as np

        # np.asarray keeps a 0-d array 0-d (np.ascontiguousarray would make it 1-d: a scalar param of shape [1])
        return self.ort.OrtValue.ortvalue_from_numpy(np.asarray(array, order="C"), self.device_type, self.device_id)

    def run(self, session: Any, feeds: Mapping[str, Any], outputs: Sequence[str]) -> list[Any]:
        """Run with every feed bound where it is and every output allocated on this device."""
        io = session.io_binding()
        for k, v in feeds.items():
            io.bind_ortvalue_input(k, v)
        for o in outputs:
            io.bind_output(o, self.device_type, self.device_id)
        session.run_with_iobinding(io)
        return io.get_outputs()

    def transfer(self, value: Any, dst: OrtDevice) -> Any:
        """A copy of OrtValue `value` (on this device) on `dst`: a memcpy between logical CPUs, else through
        ONNX Runtime's host<->device copy (GPU to GPU through the host)."""
        import numpy as np

        host = value.numpy()  # on the CPU a view; from a GPU a copy into host memory
        if dst.where == "cpu":
            return dst.put(np.array(host, copy=True) if self.where == "cpu" else host)
        return dst.put(host)

    # ---- costs ----
    def measure_op(self, graph: Graph, op: Op, policy: Policy = DEFAULT_POLICY) -> Measurement:
        found = self.measure_ops(graph, [op], policy)[0]
        if isinstance(found, str):
            raise DeviceError(found, op=op.id, device=self.name)
        return found

    def measure_ops(self, graph: Graph, ops: Sequence[Op], policy: Policy = DEFAULT_POLICY) -> list[Measurement | str]:
        """Time the nodes in sweeps over all of them in graph order, each node twice in a row: the first call
        follows another node, its inputs, weights and output memory cold; the second repeats it, all of them hot.
        In a run of the model a node's inputs were just written by their producers and its output often goes to
        memory just freed (hot), while its weights were last read a run ago (cold): its cost lies between the two,
        and a sample is their mean. Timed alone, either call misses by up to 40% on small nodes
        (docs/bench/onnx.md); the mean keeps whole models within 15% of a session's time."""
        found: list[Measurement | str] = ["not measured"] * len(ops)
        window: list[int] = []
        held = 0
        for i, op in enumerate(ops):  # windows bound the memory held by all the nodes' inputs at once
            window.append(i)
            held += graph.op_bytes(op.id)
            if held >= SWEEP_BYTES or i == len(ops) - 1:
                for j, m in zip(window, self._sweep(graph, [ops[j] for j in window], policy), strict=True):
                    found[j] = m
                window, held = [], 0
        return found

    def single_node(self, graph: Graph, op: Op, seed: int = 0) -> Callable[[], Any]:
        """A call running `op` alone on this device: its session, inputs bound here, outputs allocated here.

        A node that only renames its input's memory in a session (Reshape, Squeeze, ...: ALIAS_OPS) copies it
        when alone, its input being the model's: once it ran, the call times a one-element Identity instead,
        the cost of a node that moves no data."""
        call = self._single_node(graph, op, seed)
        if op_type(op) not in ALIAS_OPS or op.call.get("domain"):
            return call
        call()  # it runs here
        return self._single_node(_trivial_graph(), _trivial_graph().ops[0], seed)

    def _single_node(self, graph: Graph, op: Op, seed: int) -> Callable[[], Any]:
        import numpy as np

        rng = np.random.default_rng(seed)
        params = [v for v in op.inputs if graph.value[v].kind == "param"] if self.params_as_initializers else []
        model, fed = op_model(graph, op, params)
        external = {
            v: self.ort.OrtValue.ortvalue_from_numpy(example_array(graph, v, rng))
            for v in params
            if static_array(graph.value[v]) is None
        }
        session = self.session(model, external, optimization="disabled")
        io = session.io_binding()
        for v in fed:
            io.bind_ortvalue_input(v, self.put(example_array(graph, v, rng)))
        for v in op.outputs:
            io.bind_output(v, self.device_type, self.device_id)
        call = functools.partial(session.run_with_iobinding, io)
        call.keep = (session, io, external)  # type: ignore[attr-defined]
        return call

    def _sweep(self, graph: Graph, ops: Sequence[Op], policy: Policy) -> list[Measurement | str]:
        found: list[Measurement | str] = ["not measured"] * len(ops)
        calls: dict[int, Callable[[], Any]] = {}
        for i, op in enumerate(ops):
            try:
                calls[i] = self.single_node(graph, op)
                calls[i]()  # allocations and kernel choice warm up; a node that fails is out
            except Exception as e:  # not on this provider: left out (contract 2, docs/ARCHITECTURE.md)
                found[i] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                calls.pop(i, None)
        for _ in range(policy.warmup):
            for call in calls.values():
                call()
        samples: dict[int, list[float]] = {i: [] for i in calls}
        live = list(calls)
        meter = rapl() if self.where == "cpu" else None
        before = meter.snapshot() if meter is not None and meter.available else None
        clock = time.thread_time if self.clock == "thread" else time.perf_counter
        while live:
            for i in live:  # a CUDA session's run returns once its stream is done
                t0 = clock()
                calls[i]()
                calls[i]()
                samples[i].append((clock() - t0) / 2)  # the mean of a cold call and a hot one (measure_ops)
            live = [i for i in live if not _enough(samples[i], policy)]
        after = meter.snapshot() if meter is not None and before is not None else None
        timed = sum(sum(s) for s in samples.values())
        utilisation = (self.threads or cpu_model()["logical_cores"]) / max(cpu_model()["logical_cores"], 1)
        for i, s in samples.items():
            t = statistics.median(s)
            if meter is not None and before is not None and after is not None and timed > 0:
                energy, source = meter.joules(before, after) * sum(s) / timed / len(s), "rapl"
            else:
                energy, source = modelled_energy(t, self.power, utilisation if self.where == "cpu" else 1.0), "model"
            found[i] = Measurement(t, energy, source, 0, len(s), relative_spread(s) if len(s) > 1 else 0.0)
        return found

    def copy_seconds(self, other: Device, nbytes: int, *, outgoing: bool, pinned: bool = True) -> float | None:
        """A transfer as the placed executor makes it (ONNX Runtime's own copies: no pinned staging)."""
        if not isinstance(other, OrtDevice):
            return None
        import numpy as np

        src, dst = (self, other) if outgoing else (other, self)
        value = src.put(np.zeros(max(nbytes, 1), dtype=np.uint8))
        policy = Policy(warmup=1, min_reps=5, max_reps=20, max_time_s=0.2)
        clock = thread_clock if self.clock == "thread" and other.clock == "thread" else perf_clock
        return statistics.median(repeat_until_stable(lambda: src.transfer(value, dst), policy, clock))

    @classmethod
    def discover(cls) -> list[DeviceInfoRow]:
        try:
            ort = onnxruntime()
        except DeviceError:
            return []
        rows = []
        for where, provider in PROVIDERS.items():
            if provider not in ort.get_available_providers():
                continue
            count = 1 if where == "cpu" else max(len(nvml_gpus()), 1)
            for i in range(count):
                dev = cls(f"ort:{where}" if where == "cpu" else f"ort:cuda:{i}")
                details = {"provider": provider, "onnxruntime": ort.__version__, "energy": dev.energy_source}
                rows.append(DeviceInfoRow(dev.name, "ort", dev.description, dev.memory_bytes, details))
        return rows


@functools.cache
def _trivial_graph() -> Graph:
    """One Identity on one float: a node that moves (almost) no data."""
    call = {
        "format": FORMAT,
        "domain": "",
        "op_type": "Identity",
        "opsets": {"": 17},
        "attributes": "",
        "args": [{"ref": "x"}],
        "outs": [{"ref": "y"}],
    }
    values = (Value("x", 4, "input", (1,), "float32"), Value("y", 4, "activation", (1,), "float32"))
    return Graph("trivial", values, (Op("identity", "onnx::Identity", ("x",), ("y",), call=call),), ("y",))
