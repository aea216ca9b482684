"""What stages read from each other, above the raw store: the committed-input check (`inputs`) and the policy
artifact (`policy`: the `<stage>/policy` HF folder, its kind check, verified and cached downloads, its version).

Depends only on forge_core.storage and the stage registry (forge_core.stages).
"""
