"""Incremental detokenization: a completion's text grown one token at a time, as Hugging Face's
text-generation-inference and vLLM do it. Each new token is decoded together with a few
tokens before it (from prefix_offset), and the text they add is taken only once it does not end
in U+FFFD, the replacement character of an incomplete UTF-8 sequence: a character split over
byte-level tokens appears whole, never as a broken half."""


class IncrementalDetokenizer:
    """tokenizer: a Hugging Face tokenizer; prompt_ids: context for the first tokens (a tokenizer
    may decode a token differently after a space or at the start of text)."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool):
        self.tokenizer = tokenizer
        self.kwargs = dict(skip_special_tokens=skip_special_tokens,
                           spaces_between_special_tokens=spaces_between_special_tokens)
        self.ids = list(prompt_ids[-6:])  # a few prompt tokens of context; never part of the text
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], **self.kwargs)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], **self.kwargs)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new


def find_stop_string(text: str, num_new_chars: int, stop: tuple[str, ...]) -> tuple[str, int] | None:
    """The first stop string that ends inside the last num_new_chars characters of text, with its
    start index; None if there is none. Only the new characters and the max(len(s)) - 1 before
    them are searched, so a stop string split over several tokens is found once it completes."""
    best = None
    for s in stop:
        i = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if i != -1 and (best is None or i < best[1]):
            best = (s, i)
    return best
