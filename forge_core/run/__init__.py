"""Worker entry points, one module per stage, run as `python -m forge_core.run <stage> --spec <uri>`.

Each stage module `forge_core.run.<stage>` defines `main(spec: StageSpec) -> None`; `forge_core.run.spec`
holds the StageSpec read from `<output_uri>/_spec.json`. This package imports nothing heavy, so the
dispatcher starts fast and a bad stage name fails before torch is imported.
"""
