"""pitstop: standby replacement and target-scale emulation for Megatron-Core and DeepSpeed.

The core modules (``layout``, ``roster``, ``plan``) are pure data and never import
torch.distributed; ``groups`` owns every process group; ``integrations`` is where a
training script calls in.
"""

__version__ = "0.1.0"
