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
        text = (f"{weekday}, {month} {day}{comma} {date.year}" if rng.random() < 0.5
                else f"{weekday}{comma} {day} {month} {date.year}")
    elif family == "ordinal":
        form = rng.randrange(3)
        nth = _ordinal(date.day)
        text = (f"{nth} of {month}{comma} {date.year}", f"{month} {nth}{comma} {date.year}",
                f"{nth} {month}{comma} {date.year}")[form]
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


def dataset(n: int, seed: int, families=FAMILIES) -> list[tuple[str, str]]:
    """``n`` pairs drawn evenly over ``families``, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [sample(rng, families[i % len(families)]) for i in range(n)]
