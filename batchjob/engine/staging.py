"""Host work of a later call, done ahead of it on another thread (`Classifier.stage`).

A call begins with host work the device waits for: its clips' patch bytes copied into memory the GPU reads,
its prompts rendered, tokenized and given positions. For a batch queued behind the running call, that work
can be done while the running call's forward keeps the device busy and its thread waits on it (MLX releases
the GIL then). The call that answers the batch takes what was staged and does the rest itself, so staging
changes when the work is done, never what it computes.

Staged work is keyed by the clip's prepared inputs (the object itself, held here so its id stays its own) and,
for a prompt, by the question and options too. What a call does not take is dropped when the call ends.
"""
from __future__ import annotations

import threading
from typing import Any, Hashable, Sequence


class StagingArea:
    """Uploads and prompts made ahead, by clip inputs; safe to use from the engine's and a staging thread. Each
    entry holds its inputs, so no other object can take their id while it lives."""

    def __init__(self):
        self._lock = threading.Lock()
        self._uploads: dict[int, tuple[Any, Any]] = {}          # id(inputs) -> (inputs, uploaded bytes)
        self._prompts: dict[Hashable, tuple[Any, Any]] = {}     # (id(inputs), question, options) -> (inputs, prompt)

    @staticmethod
    def _prompt_key(inputs, question: str, options: Sequence[str]) -> Hashable:
        return id(inputs), question, tuple(options)

    def has_upload(self, inputs) -> bool:
        with self._lock:
            return id(inputs) in self._uploads

    def put_upload(self, inputs, uploaded) -> None:
        with self._lock:
            self._uploads[id(inputs)] = (inputs, uploaded)

    def take_upload(self, inputs):
        """The bytes uploaded for `inputs` (once: the call that encodes the clip owns them), or None."""
        with self._lock:
            entry = self._uploads.pop(id(inputs), None)
        return None if entry is None else entry[1]

    def put_prompt(self, inputs, question: str, options: Sequence[str], prompt) -> None:
        with self._lock:
            self._prompts[self._prompt_key(inputs, question, options)] = (inputs, prompt)

    def take_prompt(self, inputs, question: str, options: Sequence[str]):
        """The prompt made for this request (`family.video_prompt`'s result), or None."""
        with self._lock:
            entry = self._prompts.pop(self._prompt_key(inputs, question, options), None)
        return None if entry is None else entry[1]

    def drop(self, inputs_list: Sequence[Any]) -> None:
        """Forget whatever was staged for these inputs (a call's leftovers: requests that failed first)."""
        ids = {id(x) for x in inputs_list if x is not None}
        with self._lock:
            for key in ids:
                self._uploads.pop(key, None)
            for key in [k for k in self._prompts if k[0] in ids]:
                del self._prompts[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._uploads) + len(self._prompts)
