"""The algorithms that change the weights or the graph before or during the weight pass: each one's
math (pure torch) in ``math.py`` and its stage on the graph in ``stage.py``."""
