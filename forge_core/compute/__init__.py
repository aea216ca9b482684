"""The compute layer: the Ray cluster under every stage (the only package that imports Ray).

- `cluster`: start the embedded Ray (loopback only, token auth) or join one by address; pools are node labels.
- `gang`: one stage attempt as a placement group of node agents, each running forge_core.launch on its node.
"""
