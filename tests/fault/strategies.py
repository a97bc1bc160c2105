"""Hypothesis strategies: random pipelines with random contracts and faults."""

from __future__ import annotations

from hypothesis import strategies as st

from .harness import FN_OPS, Admission, Faults, Scenario, Step

OPS = ("map", "amap", "filter", "flat_map", "branch", "merge", "batch", "bmap", "cmap",
       "stateful", "select", "verify", "escalate", "tools")
SYNC_FN_OPS = ("map", "filter", "flat_map", "branch", "bmap", "cmap", "stateful")


def _contract(draw, op: str, target: str) -> tuple:
    c: dict = {}
    if draw(st.booleans()):
        c["queue"] = draw(st.integers(1, 16))
    if op != "stateful" and draw(st.integers(0, 3)) == 0:
        c["replicas"] = draw(st.integers(2, 3))
    elif op != "stateful" and target.startswith("ray") and draw(st.integers(0, 3)) == 0:
        c["replicas"] = {"min": 1, "max": draw(st.integers(2, 3))}  # autoscaled
    if op in SYNC_FN_OPS + ("select", "verify", "escalate") and draw(st.integers(0, 3)) == 0:
        c["blocking"] = True
    if draw(st.integers(0, 3)) == 0:
        c["retries"] = draw(st.integers(1, 2))
    if draw(st.integers(0, 3)) == 0:
        c["timeout_ms"] = draw(st.sampled_from([30, 80]))
    return tuple(sorted(c.items()))


def _faults(draw, op: str, contract: tuple, target: str) -> Faults:
    if op not in FN_OPS or draw(st.booleans()):
        return Faults()
    timed = dict(contract).get("timeout_ms") is not None
    pick = st.sampled_from
    return Faults(
        always=draw(pick([0, 0, 10])),
        first=draw(pick([0, 0, 15])),
        slow=draw(pick([0, 10])) if timed else 0,
        slow_first=draw(pick([0, 15])) if timed else 0,
        hang=draw(pick([0, 10])) if timed and not target.startswith("ray") else 0,
    )


@st.composite
def scenarios(draw, target: str = "local", policy: str | None = None, interrupt: bool = False,
              max_n: int = 32, max_steps: int = 8) -> Scenario:
    """A random scenario for ``target`` ("local", "service", "ray" or "ray-service": a
    ``PipelineService`` on Ray, with the cancels and stop of "service" and the kill of
    "ray").

    policy:    always admit through a gate with that policy (else, locally, sometimes
               through a gate with a random one).
    interrupt: local: an operator sends SIGINT (Ctrl-C) when it meets one record.
    """
    n = draw(st.integers(0, max_n))
    seed = draw(st.integers(0, 2**16))
    batched = [False]  # per open stream: may carry batch records
    steps: list[Step] = []
    fans = 0
    served = target in ("service", "ray-service")
    # no escalate or tools on Ray: their scripted engines are registered in this process
    # only
    ops = [o for o in OPS if not (served and o == "batch")
           and not (target.startswith("ray") and o in ("escalate", "tools"))]
    for _ in range(draw(st.integers(0, max_steps))):
        at = draw(st.integers(0, len(batched) - 1))
        op = draw(st.sampled_from(ops))
        if op == "merge" and len(batched) < 2:
            op = "map"
        if op in ("stateful", "verify", "escalate", "tools") and batched[at]:
            op = "select"
        if op == "flat_map":
            fans += 1
            if fans > 3:
                op = "map"
        contract = _contract(draw, op, target)
        faults = _faults(draw, op, contract, target)
        size = draw(st.integers(1, 4)) if op in ("batch", "bmap") else 2
        wait = draw(st.sampled_from([0.0, 5.0])) if op in ("batch", "bmap") else 0.0
        other = -1
        if op == "merge":
            other = draw(st.integers(0, len(batched) - 1).filter(lambda j: j != at))
            batched[at] = batched[at] or batched[other]
            del batched[other]
        elif op == "branch":
            batched.append(batched[at])
        elif op == "batch":
            batched[at] = True
        steps.append(Step(op, at, other, contract, faults, size, wait))
    if policy is not None:
        admission = draw(admissions((policy,)))
    elif target in ("local", "ray") and draw(st.booleans()):
        admission = draw(admissions())
    else:
        admission = None
    sc = Scenario(n, seed, tuple(steps), fuse=draw(st.booleans()), admission=admission)
    fn_steps = [i for i, s in enumerate(steps) if s.op in FN_OPS]
    if interrupt:
        if not fn_steps:
            steps.append(Step("map", draw(st.integers(0, len(batched) - 1))))
            fn_steps = [len(steps) - 1]
        sc = _replace(sc, n=max(n, 1), steps=tuple(steps),
                      interrupt=(draw(st.sampled_from(fn_steps)),
                                 draw(st.integers(0, max(n, 1) - 1))))
    if served:
        if fn_steps and n:
            cancel = draw(st.lists(st.tuples(st.sampled_from(fn_steps),
                                             st.integers(0, n - 1)), max_size=3))
            sc = _replace(sc, cancel=tuple(cancel))
        sc = _replace(sc, stop=draw(st.integers(0, 3)) == 0,
                      max_pending=draw(st.sampled_from([None, None, 4])))
        if n and draw(st.booleans()):  # requests with their own priority and deadline
            own = st.none() | st.tuples(
                st.sampled_from([None, "batch", "standard", "interactive", 0, 5, -1]),
                st.sampled_from([None, 1.0, 5.0, 20.0, 60.0, 500.0, 60_000.0]))
            sc = _replace(sc, urgency=tuple(draw(st.lists(own, min_size=n, max_size=n))))
            if sc.admission is not None and draw(st.booleans()):
                sc = _replace(sc, admission=_replace(sc.admission, quick=True))
    if target.startswith("ray"):
        hosted = [i for i, s in enumerate(steps)]
        if hosted and n and draw(st.booleans()):
            sc = _replace(sc, kill=draw(st.sampled_from(hosted)))
        # the other side of the runtime's default: a served run all on actors, a batch
        # run with every stage that can in the driver
        sc = _replace(sc, where=draw(st.sampled_from(["", "host" if served else "driver"])))
    return sc


def admissions(policies: tuple[str, ...] = ("simultaneous", "fcfs", "slo")):
    return st.builds(Admission, st.sampled_from(policies), st.sampled_from([1, 2, 3, 8]),
                     st.sampled_from([0, 2, 8, 32]), st.sampled_from([60_000.0, 50.0]),
                     overflow=st.sampled_from([0, 0, 2]))


def _replace(sc: Scenario, **kw) -> Scenario:
    from dataclasses import replace

    return replace(sc, **kw)
