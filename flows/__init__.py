"""Prefect flows of forgeflow: post_train (the pipeline), retrain (scheduled, with promotion), the CLI."""
