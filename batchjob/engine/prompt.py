"""Question + options -> prompt token ids, through the checkpoint's own chat template.

The video comes first in the user turn (as in Qwen's examples), so every question about one clip shares the
token prefix up to the end of the video: that prefix is what the KV cache shares between questions.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .types import EngineConfig, EngineError

MAX_OPTIONS = 5


class PromptBuilder:
    """Renders prompts and knows the token id of every option label."""

    def __init__(self, tokenizer, config: EngineConfig, video_token_id: int, source: str):
        if not getattr(tokenizer, "chat_template", None):
            raise EngineError(
                f"{source}: the tokenizer has no chat template; copy tokenizer_config.json / chat_template.jinja "
                "from the original checkpoint"
            )
        self.tokenizer = tokenizer
        self.config = config
        self.video_token_id = video_token_id
        self.label_token_ids = [self._single_token(label) for label in config.option_labels]

    def _single_token(self, label: str) -> int:
        ids = self.tokenizer.encode(label, add_special_tokens=False)
        if len(ids) != 1:
            raise EngineError(
                f"option label {label!r} is {len(ids)} tokens ({ids}) for this tokenizer; the answer is read from "
                "one token's logit, so each label must be a single token. Set EngineConfig.option_labels to "
                "single-token labels such as ('A', 'B', 'C', 'D', 'E')"
            )
        return ids[0]

    def check_options(self, options: Sequence[str]) -> None:
        """Per-request check (the caller turns the ValueError into that request's error result)."""
        limit = min(MAX_OPTIONS, len(self.config.option_labels))
        if not 2 <= len(options) <= limit:
            raise ValueError(f"a question needs 2 to {limit} options, got {len(options)}")
        empty = [i for i, o in enumerate(options) if not str(o).strip()]
        if empty:
            raise ValueError(f"options {empty} are empty; every option needs text")

    def user_text(self, question: str, options: Sequence[str]) -> str:
        self.check_options(options)
        lines = "\n".join(f"{label}. {text}" for label, text in zip(self.config.option_labels, options))
        return self.config.prompt_template.format(question=question, options=lines)

    def rendered(self, question: str, options: Sequence[str]) -> str:
        """The chat template's text for the question, with the template's own video placeholder."""
        messages = []
        if self.config.system_prompt is not None:
            messages.append({"role": "system", "content": self.config.system_prompt})
        messages.append({"role": "user", "content": [
            {"type": "video"}, {"type": "text", "text": self.user_text(question, options)}]})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def token_ids(self, question: str, options: Sequence[str], num_video_tokens: int) -> np.ndarray:
        """Prompt ids with the one video placeholder expanded to `num_video_tokens` copies."""
        rendered = self.rendered(question, options)
        ids = np.asarray(self.tokenizer.encode(rendered, add_special_tokens=False), dtype=np.int64)
        where = np.flatnonzero(ids == self.video_token_id)
        if len(where) != 1:
            raise EngineError(
                f"the chat template rendered {len(where)} video placeholders (token {self.video_token_id}); "
                "expected exactly one. Is this the checkpoint's own template?"
            )
        at = int(where[0])
        return np.concatenate([ids[:at], np.full(num_video_tokens, self.video_token_id, np.int64), ids[at + 1:]])

    def option_token_ids(self, num_options: int) -> list[int]:
        return self.label_token_ids[:num_options]
