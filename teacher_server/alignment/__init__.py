"""Cross-tokenizer alignment: a teacher of one tokenizer answering a student of another.

Pure numpy over the tokenizer objects passed in (docs/cross_tokenizer.md):

- :mod:`.token_bytes`: the bytes of every token id of a tokenizer;
- :mod:`.boundaries`: which student rows are teacher rows, by byte offsets;
- :mod:`.chain`: an aligned student token's log-prob from the teacher tokens it spans;
- :mod:`.vocab_map`: teacher ids to student ids of identical bytes, and a teacher top-k
  row in student ids.
"""

from teacher_server.alignment.boundaries import Alignment, RowKind, align_lengths, align_tokens
from teacher_server.alignment.chain import chain_logprobs
from teacher_server.alignment.token_bytes import TokenBytes, token_bytes
from teacher_server.alignment.vocab_map import VocabMap, build_vocab_map, project_topk

__all__ = [
    "Alignment",
    "RowKind",
    "TokenBytes",
    "VocabMap",
    "align_lengths",
    "align_tokens",
    "build_vocab_map",
    "chain_logprobs",
    "project_topk",
    "token_bytes",
]
