"""Stage workers and how stages run: `python -m forge_core.run <stage> --spec <uri>`.

The stages are the registry's (forge_core.stages); each record names its body ("module:function", e.g.
forge_core.run.sft:train), which the worker scaffold (forge_core.run.scaffold) calls with a checked
StageContext. `forge_core.run.spec` holds the StageSpec a run reads from `<output_uri>/_specs/<attempt>.json`;
`plan` keys and plans a stage; `runner` / `runners` run a planned attempt on the Ray cluster (its own launch,
the task's process, or the flow's trainer group) and `resources` owns the flow run's long-lived parts. This package's __init__
imports nothing heavy, so the dispatcher starts fast and a bad stage name fails before torch is imported.
"""
