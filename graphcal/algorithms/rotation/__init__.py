"""Rotations folded into a model's weights (QuaRot, SpinQuant R1): the matrices and the graph transform."""
