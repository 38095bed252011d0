"""A seeded synthetic world for `searchqa`: made-up people with a birth city, a birth year and a job.

The names are invented from syllables, so no model knows the answers: a question about "Zorvan Keel"
is answerable only by retrieving his document. Knows nothing about retrieval or scoring. Invariants:
`make_world(seed, n)` is a pure function of its arguments; person names are unique, and no name word
is also a city, so a search for a name finds that person's document.

One document per person, at most ~100 characters, e.g.
    "Zorvan Keel was born in Tamsk in 1843. Zorvan Keel works as a potter."
"""

from __future__ import annotations

from dataclasses import dataclass

from pnyx.envs.base import seeded_rng
from pnyx.envs.retrieval import Doc
from pnyx.errors import ConfigError

_ONSETS = [
    "b",
    "d",
    "f",
    "g",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "kr",
    "th",
    "sh",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "o"]
_CODAS = ["", "", "n", "r", "l", "s", "k", "m", "th", "x"]
_CITY_ENDS = ["sk", "ora", "heim", "vik", "burg", "ton", "mar", "dal"]
OCCUPATIONS = [
    "potter", "baker", "sailor", "weaver", "farmer", "painter", "miner", "tailor", "smith", "fisher",
    "carpenter", "mason", "doctor", "teacher", "singer", "hunter", "brewer", "cook", "judge", "poet",
]  # fmt: skip

# attribute -> (question template, how the answer is read off a person)
QUESTIONS: dict[str, str] = {
    "city": "Where was {name} born?",
    "year": "When was {name} born?",
    "job": "What does {name} work as?",
}


@dataclass(frozen=True)
class Person:
    name: str
    city: str
    year: int
    job: str

    def attribute(self, attr: str) -> str:
        return {"city": self.city, "year": str(self.year), "job": self.job}[attr]

    def document(self, index: int) -> Doc:
        text = f"{self.name} was born in {self.city} in {self.year}. {self.name} works as a {self.job}."
        return Doc(id=f"p{index}", title=self.name, text=text)


@dataclass(frozen=True)
class World:
    seed: int
    people: list[Person]

    def documents(self) -> list[Doc]:
        return [p.document(i) for i, p in enumerate(self.people)]


def _syllable(rng) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def make_world(seed: int = 0, num_people: int = 500, num_cities: int = 40) -> World:
    """The world for `seed`: `num_people` people born in `num_cities` invented cities."""
    if not 1 <= num_people <= 100_000 or not 1 <= num_cities <= 1000:
        raise ConfigError(
            f"world size out of range: num_people={num_people} (1..100000), num_cities={num_cities}"
        )
    rng = seeded_rng("searchqa-world", seed)
    cities: list[str] = []
    while len(cities) < num_cities:
        city = (_syllable(rng) + rng.choice(_CITY_ENDS)).capitalize()
        if city not in cities:
            cities.append(city)
    city_words = {c.lower() for c in cities}
    people: list[Person] = []
    names: set[str] = set()
    while len(people) < num_people:
        first = (_syllable(rng) + _syllable(rng)).capitalize()
        last = _syllable(rng).capitalize()
        if len(last) < 3:
            last += rng.choice(["ek", "ov", "an"])
        name = f"{first} {last}"
        if name in names or first.lower() in city_words or last.lower() in city_words:
            continue
        names.add(name)
        people.append(
            Person(
                name=name, city=rng.choice(cities), year=rng.randint(1700, 1999), job=rng.choice(OCCUPATIONS)
            )
        )
    return World(seed=seed, people=people)
