"""One JSON record too long to hold whole (a .jsonl line of a gigabyte): its text field decoded a chunk at a time, and
the rest of it checked as JSON on the way, in memory bounded by a chunk whatever the record's size."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import BinaryIO

from keel.data.sources.base import READ_BYTES, incremental_decoder
from keel.errors import ConfigError

# One whole unit of a JSON string's body: a run of plain characters, or one escape. A high surrogate's escape goes
# with the low one after it (json joins the two into one character), and alone only where what follows shows it is
# not followed by one: at the end of a chunk it waits for the next. Anything else (a bad escape, a raw control
# character) is left to json's own string decoder to reject.
STRING_UNITS = re.compile(
    r"""(?:
      [^"\\]+
    | \\["\\/bfnrt]
    | \\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}
    | \\u[dD][89abAB][0-9a-fA-F]{2}(?=[^\\]|\\[^u]|\\u[0-9a-fA-F]{4})
    | \\u(?![dD][89abAB])[0-9a-fA-F]{4}
)*""",
    re.VERBOSE,
)
LONGEST_UNIT = 12  # a surrogate pair's two escapes: a shorter tail of a chunk that is no unit may be one cut short
SHOWN_KEYS = 20  # keys named when a record has no text field
SPACE = re.compile(r"[ \t\n\r]*")
SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|true|false|null|NaN|-?Infinity")
# read on while fewer characters than this follow a scalar's match: a chunk may have cut it short ("-2500." of
# "-2500.0e+3", "tr" of "true"), and what follows it shows whether it was
SCALAR_LOOKAHEAD = len("-Infinity")


def line_chunks(head: bytes, lines: BinaryIO) -> Iterator[bytes]:
    """The bytes of a line whose first bytes, `head`, were read already, READ_BYTES at a time, to its end."""
    yield from (head[start : start + READ_BYTES] for start in range(0, len(head), READ_BYTES))
    while not head.endswith(b"\n") and (head := lines.readline(READ_BYTES)):
        yield head


class LongRecord:
    """Reads the JSON record on the line that starts with `head` (bytes in `encoding`) and goes on in `lines`, a
    chunk at a time."""

    def __init__(self, head: bytes, lines: BinaryIO, encoding: str, where: str) -> None:
        if codecs.lookup(encoding).name == "utf-8":  # as json.loads reads UTF-8 bytes: a byte-order mark dropped,
            self._decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="surrogatepass")  # lone surrogates kept
        else:
            self._decoder = incremental_decoder(encoding, head, "strict")
        self._chunks, self._encoding, self._where = line_chunks(head, lines), encoding, where
        self._text, self._at, self._ended = "", 0, False
        self._dropped, self._bytes = 0, 0  # characters before _text, bytes decoded

    def text_pieces(self, field: str) -> Iterator[str]:
        """The string value of the record's top-level `field` in decoded pieces (none for null); then the rest of
        the record is read, and a ConfigError raised if it is not JSON or has no such field."""
        if self._next() != "{":
            self._skip_value()
            self._refuse_remainder()
            raise ConfigError(
                f"data.text_files.text_field: {self._where} has no field {field!r} (it is not a JSON object)"
            )
        self._at += 1
        seen, found = False, []  # found: the first SHOWN_KEYS other keys, for a record without `field`
        if self._next() != "}":
            while True:
                if self._next() != '"':
                    raise self._malformed("a key in double quotes")
                key = ""
                for piece in self._string():
                    key += piece[: len(field) + 100 - len(key)]
                self._expect(":")
                if key == field:
                    if seen:
                        raise ConfigError(f"data.text_files.text_field: {self._where} has field {field!r} twice")
                    seen = True
                    yield from self._text_value(field)
                else:
                    self._skip_value()
                    found += [key][: SHOWN_KEYS - len(found)]
                if self._next() != ",":
                    break
                self._at += 1
        self._expect("}")
        self._refuse_remainder()
        if not seen:
            raise ConfigError(
                f"data.text_files.text_field: {self._where} has no field {field!r} (found: {', '.join(found)})"
            )

    def _text_value(self, field: str) -> Iterator[str]:
        if (start := self._next()) == '"':
            yield from self._string()
        elif start != "n" or self._scalar() != "null":
            raise ConfigError(
                f"data.text_files.text_field: {self._where}: {field!r} is not a string or null (a line "
                "this long is read as a stream, which takes the text field's string alone)"
            )

    def _more(self) -> bool:
        """Decodes the next chunk onto the text not yet read; False at the end of the line."""
        if self._ended:
            return False
        chunk = next(self._chunks, None)
        self._ended = chunk is None
        held = len(self._decoder.getstate()[0])  # bytes of a character the last chunk cut, decoded with this one
        try:
            decoded = self._decoder.decode(chunk or b"", final=self._ended)
        except UnicodeDecodeError as err:
            undecodable = err.object[err.start : err.end]
            raise self._not_json(f"{undecodable!r}: {err.reason}", f"byte {self._bytes - held + err.start:,}") from None
        self._bytes += len(chunk or b"")
        self._dropped += self._at
        self._text, self._at = self._text[self._at :] + decoded, 0
        return True

    def _next(self) -> str:
        """The next character past whitespace ('' at the end of the line), not consumed."""
        while True:
            self._at = SPACE.match(self._text, self._at).end()
            if self._at < len(self._text) or not self._more():
                return self._text[self._at : self._at + 1]

    def _expect(self, character: str) -> None:
        if self._next() != character:
            raise self._malformed(repr(character))
        self._at += 1

    def _string(self) -> Iterator[str]:
        """The decoded pieces of the JSON string that starts here, read past its closing quote."""
        opened, self._at = self._character(self._at), self._at + 1
        while True:
            end = STRING_UNITS.match(self._text, self._at).end()
            if end > self._at:
                try:
                    yield json.decoder.scanstring(self._text[self._at : end] + '"', 0)[0]
                except ValueError as err:  # a raw control character
                    raise self._not_json(err.msg.removesuffix(" at"), self._character(self._at + err.pos)) from None
                self._at = end
            if self._text[end : end + 1] == '"':
                self._at = end + 1
                return
            if len(self._text) - end >= LONGEST_UNIT or not self._more():
                try:  # no unit, and not a unit cut short either: json names what is wrong
                    json.decoder.scanstring(self._text, self._at)
                except ValueError as err:
                    at = opened if err.msg.startswith("Unterminated") else self._character(err.pos)
                    raise self._not_json(err.msg.removesuffix(" at"), at) from None
                raise self._malformed("a JSON string")

    def _scalar(self) -> str:
        """The number, true, false or null that starts here, read past it."""
        while True:
            match = SCALAR.match(self._text, self._at)
            if len(self._text) - (match.end() if match else self._at) >= SCALAR_LOOKAHEAD or not self._more():
                break
        if match is None:
            raise self._malformed("a JSON value")
        self._at = match.end()
        return match.group()

    def _skip_value(self) -> None:
        """Reads past the JSON value that starts here."""
        start = self._next()
        if start == '"':
            for _ in self._string():
                pass
        elif start in ("{", "["):
            self._at += 1
            close = "}" if start == "{" else "]"
            if self._next() == close:
                self._at += 1
                return
            while True:
                if close == "}":
                    if self._next() != '"':
                        raise self._malformed("a key in double quotes")
                    self._skip_value()
                    self._expect(":")
                self._skip_value()
                if self._next() == close:
                    self._at += 1
                    return
                self._expect(",")
        else:
            self._scalar()

    def _refuse_remainder(self) -> None:
        if self._next():
            raise self._malformed("the end of the line")

    def _malformed(self, expected: str) -> ConfigError:
        found = repr(self._text[self._at]) if self._at < len(self._text) else "the end of the line"
        return self._not_json(f"expected {expected}, found {found}", self._character(self._at))

    def _character(self, index: int) -> str:
        return f"character {self._dropped + index:,}"

    def _not_json(self, what: str, position: str) -> ConfigError:
        return ConfigError(
            f"data.text_files.paths: {self._where} is not {self._encoding} JSON ({what} at {position}); "
            "another encoding is read with data.encoding=CODEC"
        )
