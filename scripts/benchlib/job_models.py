"""The models the whole-job benchmark runs: each is a shipped job config and the published shape of the checkpoint
that config names, so the random model on disk is the one a user's nightly job would load (cut to fewer layers
only when asked)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class JobModel:
    model_type: str        # config.json's model_type: picks the engine's model family
    config: Path           # the shipped job config users run for it

    def shipped(self) -> dict:
        import yaml

        return yaml.safe_load(self.config.read_text())

    @property
    def hub_id(self) -> str:
        return self.shipped()["model"]["checkpoint"]

    @property
    def clip_budget(self) -> bool:
        """Whether model.max_pixels bounds the whole clip (Qwen3-VL's video processor) instead of each frame."""
        from batchjob.engine.preprocess import CLIP_BUDGET_MODEL_TYPES

        return self.model_type in CLIP_BUDGET_MODEL_TYPES

    def dims(self, small: bool) -> dict:
        """The random model's shape: the published one, or the family's tiny one (`small`: smoke runs)."""
        from batchjob.synthetic.random_engine import SHAPES

        return SHAPES[self.model_type][1 if small else 0]

    def max_pixels(self) -> int:
        """The shipped config's model.max_pixels, in the family's own unit (per frame, or per clip)."""
        return int(self.shipped()["model"]["max_pixels"])


MODELS = {
    "qwen2_5_vl": JobModel("qwen2_5_vl", ROOT / "configs" / "nextqa.yaml"),
    "qwen3_vl": JobModel("qwen3_vl", ROOT / "configs" / "nextqa-qwen3vl.yaml"),
}


def published_mismatches(model: JobModel) -> dict[str, tuple]:
    """Fields where the random model's published shape (`dims(False)`) differs from the shipped config's hub
    checkpoint in `published_configs` (empty when they agree): the benchmark must build the model users run."""
    from batchjob.engine.published_configs import PUBLISHED_CONFIGS

    hub = PUBLISHED_CONFIGS[model.hub_id]
    text = hub.get("text_config", hub)
    vision = hub["vision_config"]
    d = model.dims(False)
    want = {"hidden": text["hidden_size"], "layers": text["num_hidden_layers"], "heads": text["num_attention_heads"],
            "kv_heads": text["num_key_value_heads"], "inter": text["intermediate_size"], "v_depth": vision["depth"],
            "v_hidden": vision["hidden_size"], "v_heads": vision["num_heads"],
            "v_inter": vision["intermediate_size"]}
    if "head_dim" in text:
        want["head_dim"] = text["head_dim"]
    if "deepstack_visual_indexes" in vision:
        want["deepstack"] = tuple(vision["deepstack_visual_indexes"])
    if "fullatt_block_indexes" in vision:
        want["fullatt"] = tuple(vision["fullatt_block_indexes"])
    return {k: (d.get(k), v) for k, v in want.items() if (tuple(d[k]) if isinstance(d.get(k), (list, tuple))
                                                          else d.get(k)) != v}
