"""dittrain: fine-tune diffusion transformers on small GPUs by streaming blocks from pinned CPU RAM."""

__version__ = "0.1.0"
