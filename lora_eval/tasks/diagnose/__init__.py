"""diagnose: where, layer by layer, the engine parts from a reference computation (one decoder
layer read alone for layer-by-layer runs, LoRA effects per module).
May import what tasks/ may."""
