"""`dittrain caption DATA_DIR --model PATH`: write the `.txt` caption `fit` reads beside every image and video of a
folder that has none, with a local vision-language model whose decoder layers the offload conductor streams.

    from trainer.captioning import CaptionRequest, run_caption
    summary = run_caption(CaptionRequest(data_dir=Path("my_images"), model=Path("/models/Qwen2.5-VL-7B-Instruct"),
                                         style="tags", batch=8))
    summary.written, summary.skipped, summary.failed

Modules: files.py (which files, what the model sees of each, the caption file), vlm.py (loading the model and its
processor, streaming its layers, one batched `generate`), run.py (the run and its progress, Ctrl-C and summary).
"""

from .captioner import STYLES, CaptionRequest, CaptionSummary, caption_sources, run_caption

__all__ = ["STYLES", "CaptionRequest", "CaptionSummary", "caption_sources", "run_caption"]
