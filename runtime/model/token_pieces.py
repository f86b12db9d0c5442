"""The bytes a vocabulary's token stands for: byte-level BPE spells bytes in GPT-2's
printable alphabet, SentencePiece writes "▁" for a space and <0xXX> for a byte."""

import re


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# str.translate table: byte-level character -> the byte it spells, as a latin-1 char.
# Characters below 256 that are not in the alphabet (space, newline, ...) map to one
# that latin-1 cannot encode, so a token holding them falls back to its raw UTF-8.
_BYTE_LEVEL_DECODE = {c: "\uffff" for c in range(256)} | {
    ord(ch): chr(b) for b, ch in _bytes_to_unicode().items()
}


def byte_level_piece(token: str) -> bytes:
    """The bytes a byte-level token spells; a token outside the alphabet stands for itself
    (tokenizers' ByteLevel decoder does the same)."""
    try:
        return token.translate(_BYTE_LEVEL_DECODE).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def sentencepiece_piece(token: str) -> bytes:
    """The bytes a SentencePiece token spells: <0xXX> is that byte, "▁" is a space."""
    m = _BYTE_TOKEN.fullmatch(token) if token.startswith("<0x") else None
    if m:
        return bytes([int(m.group(1), 16)])
    return token.replace("▁", " ").encode("utf-8")
