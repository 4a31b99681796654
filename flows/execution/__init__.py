"""The machinery that runs a flow's stages, not a flow itself: the executor (this node or a
Ray cluster and its agents), GPU devices and pools, and the Prefect task wrappers of a stage.
"""
