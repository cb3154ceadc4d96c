"""The calibration pipeline's stages: plan, observers, the activation pass, layer blocks, the weight pass, torchrun."""
