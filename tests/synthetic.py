"""Small generated corpora with learnable patterns, for training tests, and
their prepared data directories."""

import random


def pattern_corpus(path, documents=400, seed=0):
    """Sentences from a tiny grammar: learnable, so the loss must fall."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the old man", "our teacher"]
    verbs = ["reads", "finds", "likes", "paints", "sells"]
    objects = ["a book", "the red ball", "some bread", "a small boat", "the map"]
    lines = []
    for _ in range(documents):
        sentences = [
            f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}."
            for _ in range(rng.randint(2, 5))
        ]
        lines.append(" ".join(sentences) + "\n\n")
    path.write_text("".join(lines))


def repeated_letter_corpus(path, documents=600, seed=0):
    """Sentences that repeat one letter: a masked letter is its neighbours'."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrst"
    docs = []
    for _ in range(documents):
        sentences = [" ".join([rng.choice(letters)] * rng.randint(5, 8)) + "."
                     for _ in range(rng.randint(3, 6))]
        docs.append(" ".join(sentences))
    path.write_text("\n\n".join(docs) + "\n")


def prepared(corpus, output, *flags):
    """Runs `python -m pipelines.prepare --input corpus --output output *flags`
    in this process; returns `output`."""
    from pipelines import prepare

    assert prepare.main(["--input", str(corpus), "--output", str(output), *map(str, flags)]) == 0
    return output
