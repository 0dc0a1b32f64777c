"""The training corpus: plain everyday English from Debian's `fortunes` package (quotations and
literature excerpts, BSD licence) beside technical prose from Python's own tutorial (the
`python3.11-doc` package's reST sources, PSF licence). Every 20th document, in a seeded shuffle,
is held out.

    apt-get install fortunes python3.11-doc
"""

import random
from pathlib import Path

FORTUNES = Path("/usr/share/games/fortunes")
TUTORIAL = Path("/usr/share/doc/python3.11/html/_sources/tutorial")
HELD_OUT_EVERY = 20


def fortunes():
    """Each fortune of every (inoffensive) fortunes file, in file order."""
    docs = []
    for f in sorted(FORTUNES.iterdir()):
        if f.suffix or not f.is_file():
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        for entry in text.split("\n%\n"):
            entry = entry.strip("%\n ")
            if len(entry) >= 20:
                docs.append(entry + "\n")
    return docs


def tutorial():
    """Each paragraph of Python's tutorial, in file order."""
    docs = []
    for f in sorted(TUTORIAL.glob("*.rst.txt")):
        text = f.read_text(encoding="utf-8", errors="replace")
        for para in text.split("\n\n"):
            para = para.strip("\n")
            if len(para) >= 40:
                docs.append(para + "\n")
    return docs


def split(seed):
    """(training documents, held-out documents), the same for the same seed."""
    docs = fortunes() + tutorial()
    random.Random(seed).shuffle(docs)
    held = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY == 0]
    train = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY != 0]
    return train, held


if __name__ == "__main__":
    train, held = split(0)
    print(len(train), sum(map(len, train)), len(held), sum(map(len, held)))
