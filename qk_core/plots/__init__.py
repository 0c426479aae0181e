"""Figures (SPEC 7), built on matplotlib.figure.Figure directly (no pyplot state; Agg)."""
