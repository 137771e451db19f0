"""The stories' word-level tokenizer (real_model): the toy tokenizer on the grammar's words.

Every word and punctuation mark of the grammar is one token; BOS (id 0) starts every story,
and a blank line in the text separates stories. The vocabulary ships beside the trained
models as vocab.json ({token: id}, in id order, the layout the model hub uses).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..checks import as_flag, as_token_ids
from ..tokenizer import ToyTokenizer
from . import grammar


class StoryTokenizer(ToyTokenizer):
    """Words of the story grammar <-> ids.

    >>> tokenizer = StoryTokenizer()
    >>> ids = tokenizer.encode("Mia had a red ball.")
    >>> tokenizer.tokens(ids)
    ['<bos>', 'Mia', 'had', 'a', 'red', 'ball', '.']
    >>> tokenizer.decode(ids)
    'Mia had a red ball.'

    Case is ignored when encoding; decoding writes names with their capital and capitalizes
    the first word of each sentence, so decode(encode(story)) gives the story back.
    """

    def __init__(self, vocabulary: tuple[str, ...] = grammar.VOCABULARY):
        super().__init__(vocabulary)

    @classmethod
    def from_directory(cls, directory) -> StoryTokenizer:
        """Read vocab.json ({token: id}, ids 0..V-1) from a model directory."""
        path = Path(directory) / "vocab.json"
        if not path.is_file():
            raise FileNotFoundError(f"no vocab.json in {directory}: a stories model directory "
                                    "holds config.json, model.safetensors and vocab.json")
        ids = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(ids, dict) or sorted(ids.values()) != list(range(len(ids))):
            raise ValueError(f"{path} must map each token to its id, the ids 0 to n-1 each once")
        return cls(tuple(sorted(ids, key=ids.get)))

    def to_json(self) -> str:
        """The vocabulary as vocab.json holds it: {token: id} in id order."""
        return json.dumps({word: index for index, word in enumerate(self.vocabulary)},
                          ensure_ascii=False, indent=0)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Text -> ids: BOS in front of every story (stories are separated by a blank line);
        add_bos=False leaves it out in front of the first one (to continue a story)."""
        words, add_bos = grammar.text_to_words(text), as_flag("add_bos", add_bos)
        unknown = list(dict.fromkeys(w for w in words if w.lower() not in self._ids))
        if unknown:
            raise ValueError(f"unknown word(s) {unknown}: the story vocabulary has "
                             f"{len(self)} tokens (see StoryTokenizer().words())")
        ids = [self._ids[word.lower()] for word in words]
        return ids if add_bos else ids[1:]

    def tokens(self, ids) -> list[str]:
        """Ids -> token strings, BOS included (for labelling plots)."""
        array = as_token_ids(ids, len(self), what="token ids", empty=True)
        return [self.vocabulary[int(i)] for i in array]

    def decode(self, ids) -> str:
        """Ids -> text: sentences capitalized, a blank line where a new story starts (BOS)."""
        return grammar.words_to_text(self.tokens(ids))

