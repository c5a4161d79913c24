"""Dates written by people, and their ISO form: the data of :class:`DateTranslator`.

Years 1900-2099. Families (each with its own variations):

- ``month_first``: "March 25, 2019", "mar 25 2019", "MARCH 05, 2019"
- ``day_first``: "25 March 2019", "25 mar, 2019"
- ``weekday``: "Monday, March 25, 2019", "mon 25 march 2019" (the right weekday)
- ``ordinal``: "25th of March 2019", "March 25th, 2019", "25th mar 2019"
- ``chinese``: "2019年3月25日", "2019年03月25日"
- ``iso``: "2019-03-25"

Month and weekday names come in full or as three letters, in lower, upper or title
case, with or without commas.

>>> import random
>>> sample(random.Random(0), "ordinal")
('1ST APRIL 2038', '2038-04-01')
"""

from __future__ import annotations

import calendar
import datetime
import random
import re
from collections.abc import Sequence

FAMILIES = ("month_first", "day_first", "weekday", "ordinal", "chinese", "iso")
MONTHS = [calendar.month_name[m] for m in range(1, 13)]
WEEKDAYS = [calendar.day_name[d] for d in range(7)]
FIRST = datetime.date(1900, 1, 1).toordinal()
LAST = datetime.date(2099, 12, 31).toordinal()


def random_date(rng: random.Random) -> datetime.date:
    """A uniform date in 1900-2099."""
    return datetime.date.fromordinal(rng.randint(FIRST, LAST))


def _ordinal(day: int) -> str:
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def _name(names: list[str], index: int, rng: random.Random) -> str:
    return names[index] if rng.random() < 0.5 else names[index][:3]


def _case(text: str, rng: random.Random) -> str:
    return rng.choice((str.lower, str.upper, lambda s: s))(text)


def render(date: datetime.date, family: str, rng: random.Random) -> str:
    """``date`` written the way ``family`` writes dates, with random variations."""
    comma = "," if rng.random() < 0.5 else ""
    month = _name(MONTHS, date.month - 1, rng)
    day = f"{date.day:02d}" if rng.random() < 0.2 else str(date.day)
    if family == "month_first":
        text = f"{month} {day}{comma} {date.year}"
    elif family == "day_first":
        text = f"{day} {month}{comma} {date.year}"
    elif family == "weekday":
        weekday = _name(WEEKDAYS, date.weekday(), rng)
        text = (
            f"{weekday}, {month} {day}{comma} {date.year}"
            if rng.random() < 0.5
            else f"{weekday}{comma} {day} {month} {date.year}"
        )
    elif family == "ordinal":
        form = rng.randrange(3)
        nth = _ordinal(date.day)
        text = (
            f"{nth} of {month}{comma} {date.year}",
            f"{month} {nth}{comma} {date.year}",
            f"{nth} {month}{comma} {date.year}",
        )[form]
    elif family == "chinese":
        pad = rng.random() < 0.3
        return f"{date.year}年{date.month:02d}月{date.day:02d}日" if pad else f"{date.year}年{date.month}月{date.day}日"
    elif family == "iso":
        return date.isoformat()
    else:
        raise ValueError(f"family must be one of {FAMILIES}, but got {family!r}.")
    return _case(text, rng)


def sample(rng: random.Random, family: str | None = None) -> tuple[str, str]:
    """One ``(text, iso)`` pair; ``family`` None picks one at random."""
    date = random_date(rng)
    return render(date, family or rng.choice(FAMILIES), rng), date.isoformat()


def dataset(n: int, seed: int, families: Sequence[str] = FAMILIES) -> list[tuple[str, str]]:
    """``n`` pairs drawn evenly over ``families``, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [sample(rng, families[i % len(families)]) for i in range(n)]


# --- reading: which texts are dates in a supported format --------------------------------------

_MONTH = "|".join(sorted({m.lower() for m in MONTHS} | {m[:3].lower() for m in MONTHS}, key=len, reverse=True))
_WEEKDAY = "|".join(sorted({d.lower() for d in WEEKDAYS} | {d[:3].lower() for d in WEEKDAYS}, key=len, reverse=True))
_D = r"(?P<day>0?[1-9]|[12][0-9]|3[01])"
_DTH = _D + r"(?P<suffix>st|nd|rd|th)"
_M = rf"(?P<month>{_MONTH})"
_W = rf"(?P<weekday>{_WEEKDAY})"
_Y = r"(?P<year>\d{4})"
_PATTERNS = {  # each family's written forms, after normalize()
    "month_first": [rf"{_M} {_D},? {_Y}"],
    "day_first": [rf"{_D} {_M},? {_Y}"],
    "weekday": [rf"{_W}, {_M} {_D},? {_Y}", rf"{_W},? {_D} {_M} {_Y}"],
    "ordinal": [rf"{_DTH} of {_M},? {_Y}", rf"{_M} {_DTH},? {_Y}", rf"{_DTH} {_M},? {_Y}"],
    "chinese": [r"(?P<year>\d{4})年(?P<mnum>0?[1-9]|1[0-2])月(?P<day>0?[1-9]|[12][0-9]|3[01])日"],
    "iso": [r"(?P<year>\d{4})-(?P<mnum>0[1-9]|1[0-2])-(?P<day>0[1-9]|[12][0-9]|3[01])"],
}
_COMPILED = {family: [re.compile(rf"^(?:{form})$") for form in forms] for family, forms in _PATTERNS.items()}


def normalize(text: str) -> str:
    """Whitespace collapsed to single spaces and trimmed, letters lower-cased."""
    return " ".join(text.split()).lower()


def _month_number(name: str) -> int:
    return next(i + 1 for i, m in enumerate(MONTHS) if m.lower().startswith(name[:3]))


def read(text: str) -> tuple[datetime.date | None, str]:
    """``(date, "")`` when ``text`` is a date in one of :data:`FAMILIES`'s formats, else ``(None, why)``.

    Years 1900-2099 only; the day must exist in that month and year; a weekday, if
    given, must be the date's; an ordinal suffix must be the day's (1st, 2nd, 3rd,
    4th...). This is what :meth:`DateTranslator.translate` checks its answers against.

    >>> read("  25 March   2019 ")
    (datetime.date(2019, 3, 25), '')
    >>> read("31 February 2019")[1]
    'there is no 31 February 2019'
    """
    if not isinstance(text, str):
        return None, f"not a text but {type(text).__name__}"
    clean = normalize(text)
    if not clean:
        return None, "the text is empty"
    for patterns in _COMPILED.values():
        for pattern in patterns:
            match = pattern.match(clean)
            if match is None:
                continue
            fields = match.groupdict()
            year, day = int(fields["year"]), int(fields["day"])
            month = int(fields["mnum"]) if fields.get("mnum") else _month_number(fields["month"])
            if not 1900 <= year <= 2099:
                return None, f"the year {year} is outside 1900-2099, the years the model knows"
            try:
                date = datetime.date(year, month, day)
            except ValueError:
                return None, f"there is no {day} {MONTHS[month - 1]} {year}"
            if fields.get("weekday") and not WEEKDAYS[date.weekday()].lower().startswith(fields["weekday"][:3]):
                return None, f"{date.isoformat()} is a {WEEKDAYS[date.weekday()]}, not a {fields['weekday']}"
            if fields.get("suffix") and _ordinal(day) != f"{day}{fields['suffix']}":
                return None, f"the ordinal of {day} is {_ordinal(day)}, not {day}{fields['suffix']}"
            return date, ""
    return None, (
        "not a date in a supported format (e.g. 'March 25, 2019', '25 March 2019', "
        "'Monday, March 25, 2019', '25th of March 2019', '2019年3月25日', '2019-03-25')"
    )
