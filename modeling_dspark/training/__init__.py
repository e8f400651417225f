"""How a drafter is trained: self-distilled data, the losses, the Trainer, calibration, adaptation, ablations."""
