"""Evaluation: a phase's eval set generated and scored, its metrics, FID and report."""
