"""The "torch.distributed on r2comm vs Gloo" section of bench/RESULTS.md (issue 29), from three
JSON files: torch_sizes.json (bench/torch_sizes.py: time per call per size, one torchrun job per
backend and round), torch_small_call.json (bench/torch_small_call.py: the 8 B all_reduce through
torch against r2comm's numpy path, one job) and torch_fsdp2.json (bench/torch_fsdp2.py: an FSDP2
training step on each backend, one job). Called by results.render(); a missing or partial file
makes its part say so, never raise."""
import statistics

from .results_format import code, fms, fratio, fsize, fus, table

SMALL_CALL_OF_NUMPY = 2.0   # issue 29: 8 B all_reduce through torch at most 2x the numpy path
OP_NAMES = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
            "reduce_scatter": "reduce_scatter_tensor"}
TITLE = "## torch.distributed on r2comm vs Gloo (issue 29)"


def _command(res, name, doc):
    """NAME.cmd from run_all.sh, else the command line the bench recorded."""
    return res.text(f"{name}.cmd") or (doc or {}).get("command") or "(command not recorded)"


def _ftime(seconds):
    if seconds is None or seconds < 1e-3:
        return fus(None if seconds is None else seconds * 1e6)
    return fms(seconds, 2 if seconds < 0.01 else 1)


def _loads(doc):
    loads = [v for v in doc.get("loadavg") or [] if isinstance(v, (int, float))]
    if not loads:
        return ""
    return f" Load average (1 min) during the run: {min(loads):.1f}–{max(loads):.1f}."


def _median(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def _paired(a_runs, b_runs, op, size):
    """The median over rounds of the round's a / b time, or None."""
    ratios = []
    for a, b in zip(a_runs, b_runs):
        x, y = (a.get(op) or {}).get(size), (b.get(op) or {}).get(size)
        if x and y:
            ratios.append(x / y)
    return statistics.median(ratios) if ratios else None


def sizes_part(res):
    """Lines of the per-size table (torch_sizes.json)."""
    doc = res.doc("torch_sizes")
    out = ["### Collectives per message size", ""]
    if not doc:
        return out + [f"{res.why_missing('torch_sizes').capitalize()}.", ""]
    runs = doc.get("runs") or {}
    r2, gloo = runs.get("r2comm") or [], runs.get("gloo") or []
    ops = [op for op in doc.get("ops") or [] if op in OP_NAMES]
    shm = (doc.get("env") or {}).get("R2COMM_SHM")
    out += [f"{doc.get('nproc', '?')} ranks on one host, float32, SUM; the size is the whole tensor "
            "(all_reduce's, the gathered output, the scattered input). Each round is one torchrun job "
            "per backend, the first backend alternating from round to round; a job times each size "
            "as rank 0's mean over about "
            f"{doc.get('budget_s', '?')} s of calls. Shown: each backend's median over "
            f"{min(len(r2), len(gloo))} rounds, and r2comm / Gloo as the median of the rounds' "
            "ratios (below 1: r2comm faster). r2comm's two ranks meet through "
            + ("TCP loopback (`R2COMM_SHM=0`)" if shm == "0" else "shared memory")
            + ", Gloo's through TCP loopback." + _loads(doc)]
    out += code(_command(res, "torch_sizes", doc))
    head, rows = ["size"], []
    for op in ops:
        head += [f"{OP_NAMES[op]} r2comm", "Gloo", "r2comm / Gloo"]
    for size in doc.get("sizes") or []:
        key, row = str(size), [fsize(size)]
        for op in ops:
            row += [_ftime(_median((r.get(op) or {}).get(key) for r in r2)),
                    _ftime(_median((r.get(op) or {}).get(key) for r in gloo)),
                    fratio(_paired(r2, gloo, op, key))]
        rows.append(row)
    return out + table(head, rows) + [""]


def small_call_part(res):
    """(lines, targets) of the 8 B call against the numpy path (torch_small_call.json)."""
    doc = res.doc("torch_small_call")
    out = ["### An 8 B all_reduce: torch against r2comm's numpy path", ""]
    if not doc:
        return out + [f"{res.why_missing('torch_small_call').capitalize()}.", ""], []
    rounds = doc.get("rounds_us") or {}
    torch_us = _median(rounds.get("torch dist.all_reduce") or [])
    numpy_us = _median(rounds.get("numpy Communicator.Allreduce") or [])
    ratio = _median(doc.get("ratio_torch_numpy") or [])
    out += [f"One torchrun job, {doc.get('nproc', '?')} ranks on one host: `dist.all_reduce` of an "
            "8 B float32 tensor on the r2comm default group, `Communicator.Allreduce` on numpy "
            "arrays with the same group's Communicator and, for reference, the group's "
            "`allreduce` method called directly (`pg.allreduce([t], opts).wait()`: the backend "
            "without torch's `dist.all_reduce` wrapper) and `dist.all_reduce` on a Gloo group of "
            "the same ranks. Each round times "
            f"{doc.get('iters', '?')} calls of each path one by one (the order rotating from round "
            "to round) and keeps the median call; shown: the median over "
            f"{doc.get('rounds', '?')} rounds, and torch / numpy as the median of the rounds' "
            "ratios." + _loads(doc)]
    out += code(_command(res, "torch_small_call", doc))
    rows = [[path, fus(_median(v)), ", ".join(f"{x:.1f}" for x in v)] for path, v in rounds.items()]
    out += table(["path", "median per call", "rounds' medians, µs"], rows) + [""]
    if torch_us is None or numpy_us is None or ratio is None:
        return out, []
    direct = rounds.get("backend pg.allreduce") or []
    if direct:
        torch_r, numpy_r = rounds["torch dist.all_reduce"], rounds["numpy Communicator.Allreduce"]
        gap = _median([a - b for a, b in zip(torch_r, numpy_r)])
        wrapper = _median([a - b for a, b in zip(torch_r, direct)])
        method = _median([a - b for a, b in zip(direct, numpy_r)])
        out += [f"Of the {fus(gap)} a call through torch costs beyond the numpy path, "
                f"{fus(wrapper)} are torch's own `dist.all_reduce` (its checks, the options "
                f"object, the group look-up) and {fus(method)} the backend's method (the C++ "
                "helper's read of the tensor and options, the prepared Allreduce, the done Work): "
                "medians of the rounds' differences, so they need not add up.", ""]
    ok = ratio <= SMALL_CALL_OF_NUMPY
    return out, [(f"8 B all_reduce through torch ≤ {SMALL_CALL_OF_NUMPY:g}× the numpy path: "
                  f"**{'met' if ok else 'not met'}** ({fus(torch_us)} vs {fus(numpy_us)}: "
                  f"{ratio:.2f}×)", ok)]


def fsdp2_part(res):
    """(lines, targets) of the FSDP2 step (torch_fsdp2.json)."""
    doc = res.doc("torch_fsdp2")
    out = ["### An FSDP2 training step", ""]
    if not doc:
        return out + [f"{res.why_missing('torch_fsdp2').capitalize()}.", ""], []
    steps = doc.get("step_s") or {}
    r2, gloo = steps.get("r2comm") or [], steps.get("gloo") or []
    losses = doc.get("losses") or {}
    equal = bool(losses.get("r2comm")) and losses.get("r2comm") == losses.get("gloo")
    ratio = statistics.median(a / b for a, b in zip(r2, gloo)) if r2 and gloo else None
    params = doc.get("params") or 0
    out += [f"One torchrun job, {doc.get('nproc', '?')} ranks on one host (CPU, one thread each): "
            f"an MLP of {doc.get('depth', '?')} hidden Linear layers of width {doc.get('width', '?')} "
            f"({params:,} parameters, {fsize(params * 4)} in float32), `fully_shard` per Linear and "
            "at the root, SGD, batch "
            f"{doc.get('batch', '?')} per rank; once on a DeviceMesh over the r2comm default group, "
            "once on one over a Gloo group of the same ranks, trained side by side on the same "
            "batches, the first backend alternating from step to step. Each step (forward, "
            "backward with FSDP2's all-gathers and reduce-scatters, optimizer) is timed alone on "
            f"rank 0 after a barrier of its group; {doc.get('warmup', '?')} warm-up steps are not "
            "counted." + _loads(doc)]
    out += code(_command(res, "torch_fsdp2", doc))
    out += table(["backend", "median step", "steps timed"],
                 [["r2comm", _ftime(_median(r2)), str(len(r2))],
                  ["Gloo", _ftime(_median(gloo)), str(len(gloo))]]) + [""]
    out += [f"r2comm / Gloo per step (median of the steps' ratios): {fratio(ratio)}; the "
            f"{len(losses.get('r2comm') or [])} losses of the two runs are "
            + ("bitwise equal." if equal else "**not** equal."), ""]
    return out, [("FSDP2 (2 ranks, CPU) trains to the same losses as on Gloo, bit for bit: "
                  f"**{'met' if equal else 'not met'}** (step {fratio(ratio)}× Gloo's time)", equal)]


def _before(step):
    return step - 1 if isinstance(step, int) else "?"


def testbed_fsdp2_part(res):
    """(lines, targets) of FSDP2 x TP through a real NIC failure (testbed_fsdp2.json)."""
    doc = res.doc("testbed_fsdp2")
    out = ["### FSDP2 x TP through a NIC failure in the testbed", ""]
    if not doc:
        return out + [f"{res.why_missing('testbed_fsdp2').capitalize()}.", ""], []
    cfg, s = doc.get("config") or {}, doc.get("summary") or {}
    cases, nd = doc.get("cases") or {}, s.get("nic_down") or {}
    out += [f"The emulated cluster: {cfg.get('hosts', '?')} hosts x {cfg.get('nics', '?')} NICs at "
            f"{cfg.get('rate', '?')}, {cfg.get('ranks', '?')} ranks (torchrun per host), "
            "`examples/torch_fsdp2_tp.py`: a 2 x 2 DeviceMesh, TP within a host, FSDP2 across the "
            f"hosts, {s.get('params') or 0:,} parameters. In the *NIC down* run host 1's NIC 0 goes "
            f"down for real once rank 0 has finished step {_before(cfg.get('fail_step'))} and comes "
            f"back once it has finished step {_before(cfg.get('restore_step'))}; step times are "
            "rank 0's." + _loads(doc)]
    out += code(_command(res, "testbed_fsdp2", doc))
    rows = []
    for name, label in (("fsdp_r2comm_healthy", "r2comm, healthy"),
                        ("fsdp_r2comm_nic_down", "r2comm, NIC down and back"),
                        ("fsdp_gloo_healthy", "Gloo (both NICs), healthy")):
        rec = cases.get(name) or {}
        st = rec.get("step_s") or []
        rows.append([label, _ftime(_median(st[2:])), f"{len(st)} / {rec.get('steps', '?')}",
                     str(rec.get("digest")), rec.get("error") or "–"])
    out += table(["run", "median step", "steps done", "loss-curve digest", "error"], rows)
    out += ["", f"While the NIC was down: median step {_ftime(nd.get('during_median_s'))} against "
            f"{_ftime(nd.get('base_same_steps_median_s'))} for the same steps of the healthy run, "
            f"after it {_ftime(nd.get('after_median_s'))}; failover events "
            f"{s.get('failover_events') or {}}.", "",
            "![FSDP2 x TP step times, a NIC down and back](figures/testbed_fsdp2.png)", ""]
    equal = s.get("digests_equal") is True
    return out, [("FSDP2 x TP through a real NIC failure in the testbed: losses bitwise equal to "
                  f"the fault-free run: **{'met' if equal else 'not met'}**", equal)]


def torchdist_section(res):
    """(lines, targets) of the torch.distributed vs Gloo section."""
    out = [TITLE, "",
           "The torch.distributed backend (`r2comm.torch`) against Gloo on this host, three benches "
           "(each a benchmark, not a test: the machine's load moves the numbers, compare within a "
           "table).", ""]
    out += sizes_part(res)
    small, targets = small_call_part(res)
    fsdp, fsdp_targets = fsdp2_part(res)
    testbed, testbed_targets = testbed_fsdp2_part(res)
    out += small + fsdp + testbed
    targets += fsdp_targets + testbed_targets
    if not targets:     # the first line after the title is the glance table's "not run" note
        out[2:2] = [f"{res.why_missing('torch_small_call').capitalize()}; no target evaluated.", ""]
    else:
        out += ["**Against the targets** (issue 29):", ""] + [f"- {t}." for t, _ in targets] + [""]
    return out, targets
