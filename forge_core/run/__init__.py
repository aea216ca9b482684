"""Stage workers and how stages run: `python -m forge_core.run <stage> --spec <uri>`.

Each stage registered in forge_core.stages names its body ("module:function", e.g. forge_core.run.sft:train),
which the worker scaffold calls with a checked StageContext. `spec` holds the StageSpec; `plan` keys and plans a
stage; `runner` / `runners` run a planned attempt; `resources` owns the flow run's long-lived parts. This
__init__ imports nothing heavy, so a bad stage name fails before torch is imported.
"""
