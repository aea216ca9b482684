"""Scale drills: a ladder of cluster sizes, the same workload at each, clean and under injected faults, with
recovery, consistency and node health measured and judged (flows/drill.py runs them on a
forge_core.compute.simulated cluster).

    plan.py      the YAML plan (configs/drills/*.yaml)
    faults.py    one injector per fault kind
    health.py    per-node health sampled over a run
    measure.py   a run's numbers, from its manifests and the injector's strike
    report.py    the verdict, drill.json, drill.md and the plots
"""
