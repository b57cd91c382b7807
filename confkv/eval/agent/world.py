"""The seeded content of the text web: shop catalogue, wiki articles, inbox messages, forms.

:func:`make_world` is a pure function of its seed (``random.Random(seed)``, no global
state, no hash-ordered iteration), so the same seed gives the same sites, byte for byte.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

CATEGORIES = ("Laptops", "Phones", "Headphones", "Cameras", "Kitchen", "Garden")
_BRANDS = ("Nimbus", "Vertex", "Orbit", "Kestrel", "Lumen", "Cobalt", "Tundra", "Zephyr", "Argo", "Helix")
_MODELS = ("Pro", "Air", "Max", "Lite", "One", "Neo", "Ultra", "Mini", "Plus", "Prime")
_NOUNS = {"Laptops": "Laptop", "Phones": "Phone", "Headphones": "Headphones", "Cameras": "Camera",
          "Kitchen": "Blender", "Garden": "Hose Reel"}
_FIRST = ("Alice", "Bruno", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivan", "Julia", "Kofi", "Lena",
          "Marco", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara")
_LAST = ("Adler", "Brandt", "Costa", "Duarte", "Eriksen", "Fischer", "Garcia", "Hoang", "Ito", "Jansen", "Kowal",
         "Larsen", "Moreau", "Novak", "Okafor", "Petrov", "Quist", "Rossi", "Silva", "Tanaka")
_CITIES = ("Arden", "Belmora", "Castrel", "Dunmere", "Elvask", "Falkirn", "Gorvane", "Halden", "Istrava", "Jorvik",
           "Kelmoor", "Lysara", "Morvay", "Norhaven")
_BUILDINGS = ("Atlas House", "Birch Hall", "Cedar Court", "Delta Tower", "Elm Pavilion", "Fjord Centre", "Granite Wing")
_PROJECTS = ("Aurora", "Beacon", "Cascade", "Drift", "Ember", "Fathom", "Glacier")
_EVENTS = ("Data Summit", "Design Forum", "Cloud Expo", "Robotics Day", "Health Tech Fair", "Green Energy Meetup",
           "Security Workshop")
_STREETS = ("Oak Street", "Mill Road", "Harbor Lane", "Station Avenue", "Park Row", "King Street", "Bridge Way")
_FILLER = (
    "The service is available to all registered members.",
    "Further details can be found in the linked pages below.",
    "Please keep this message for your records.",
    "Opening hours may differ on public holidays.",
    "Our team reviews every request within two working days.",
    "Feedback from users helped shape the current version.",
    "Several local groups meet here on a regular basis.",
    "The archive keeps earlier versions of this information.",
)


@dataclass(frozen=True)
class Product:
    sku: str
    name: str
    category: str
    price: float  # dollars
    rating: float
    stock: int
    description: str
    specs: tuple[tuple[str, str], ...]

    @property
    def price_text(self) -> str:
        return f"${self.price:.2f}"


@dataclass(frozen=True)
class Article:
    slug: str
    title: str
    kind: str  # city, building, project
    summary: str
    sections: tuple[tuple[str, tuple[str, ...]], ...]  # (heading, paragraphs)
    facts: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class Message:
    mid: str
    sender: str
    subject: str
    date: str
    body: tuple[str, ...]  # paragraphs
    facts: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class FormSpec:
    fid: str
    title: str
    intro: str
    fields: tuple[tuple[str, str], ...]  # (key, label) textboxes, in page order
    radios: tuple[tuple[str, str, tuple[str, ...]], ...]  # (group key, label, options)
    checkboxes: tuple[tuple[str, str], ...]  # (key, label)


@dataclass
class World:
    seed: int
    products: list[Product]
    articles: list[Article]
    messages: list[Message]
    forms: list[FormSpec]
    promos: dict  # code -> percent off
    user: dict  # the user's own name, street, city, zip, email

    def product(self, sku: str) -> Product:
        return next(p for p in self.products if p.sku == sku)

    def products_in(self, category: str) -> list[Product]:
        return [p for p in self.products if p.category == category]

    def article(self, slug: str) -> Article:
        return next(a for a in self.articles if a.slug == slug)

    def message(self, mid: str) -> Message:
        return next(m for m in self.messages if m.mid == mid)

    def form(self, fid: str) -> FormSpec:
        return next(f for f in self.forms if f.fid == fid)

    def messages_of(self, kind: str) -> list[Message]:
        return [m for m in self.messages if m.facts.get("kind") == kind]

    def articles_of(self, kind: str) -> list[Article]:
        return [a for a in self.articles if a.kind == kind]


def _code(rng: random.Random, prefix: str, n: int = 4) -> str:
    alphabet = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
    return prefix + "".join(rng.choice(alphabet) for _ in range(n))


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _products(rng: random.Random) -> list[Product]:
    products, used = [], set()
    for category in CATEGORIES:
        for _ in range(10):
            while True:
                name = f"{rng.choice(_BRANDS)} {rng.choice(_MODELS)} {rng.randint(2, 19)} {_NOUNS[category]}"
                if name not in used:
                    used.add(name)
                    break
            sku = f"SKU-{rng.randint(10000, 99999)}"
            price = round(rng.uniform(19, 1400 if category in ("Laptops", "Cameras", "Phones") else 300), 2)
            specs = (("Weight", f"{rng.uniform(0.2, 3.5):.1f} kg"), ("Colour", rng.choice(("black", "silver", "blue",
                     "red", "white"))), ("Warranty", f"{rng.choice((1, 2, 3))} years"),
                     ("Model year", str(rng.randint(2019, 2025))))
            description = (f"The {name} is a {rng.choice(('compact', 'robust', 'popular', 'versatile'))} choice in "
                           f"{category.lower()}. {rng.choice(_FILLER)} Customers mention its "
                           f"{rng.choice(('battery life', 'build quality', 'price', 'design', 'ease of use'))}.")
            products.append(Product(sku, name, category, price, round(rng.uniform(2.5, 5.0), 1), rng.randint(0, 40),
                                    description, specs))
    return products


def _paragraph(rng: random.Random, *facts: str) -> str:
    sentences = list(facts) + rng.sample(_FILLER, 2)
    return " ".join(sentences)


def _articles(rng: random.Random) -> list[Article]:
    articles = []
    for city in _CITIES:
        founded, population = rng.randint(1100, 1900), rng.randint(20, 900) * 1000
        mayor, river = _person(rng), rng.choice(("Vell", "Oster", "Marn", "Tillis", "Brae"))
        sections = (
            ("Geography", (_paragraph(rng, f"{city} lies on the river {river}.",
                                      f"The city covers {rng.randint(20, 400)} square kilometres."),)),
            ("Economy", (_paragraph(rng, f"Its main industries are {rng.choice(('shipping', 'textiles', 'software'))} "
                                         f"and {rng.choice(('tourism', 'farming', 'banking'))}."),)),
            ("History", (_paragraph(rng, f"{city} was founded in {founded}.",
                                    f"It received a charter {rng.randint(10, 90)} years later."),
                         _paragraph(rng, f"The current mayor is {mayor}."))),
            ("Culture", (_paragraph(rng, f"The annual {city} festival takes place in "
                                         f"{rng.choice(('May', 'June', 'August', 'October'))}."),)),
        )
        articles.append(Article(city.lower(), city, "city", f"{city} is a city of about {population:,} people.",
                                sections, {"founded": founded, "mayor": mayor, "population": population}))
    for building in _BUILDINGS:
        rooms = {f"{building[0]}-{rng.randint(1, 6)}{rng.randint(0, 4)}{rng.randint(0, 9)}": None for _ in range(4)}
        floors = {room: int(room.split("-")[1][0]) for room in rooms}
        room_lines = tuple(f"Room {room} is on floor {floor}." for room, floor in floors.items())
        sections = (
            ("Overview", (_paragraph(rng, f"{building} opened in {rng.randint(1960, 2020)}."),)),
            ("Access", (_paragraph(rng, f"The main entrance faces {rng.choice(_STREETS)}."),)),
            ("Rooms", (" ".join(room_lines) + " " + rng.choice(_FILLER),)),
        )
        articles.append(Article(building.lower().replace(" ", "-"), building, "building",
                                f"{building} is an office building with {len(rooms)} meeting rooms.", sections,
                                {"floors": floors}))
    for project in _PROJECTS:
        code, lead = _code(rng, "PRJ-"), _person(rng)
        sections = (
            ("Goals", (_paragraph(rng, f"Project {project} develops {rng.choice(('tools', 'services', 'studies'))} "
                                       f"for {rng.choice(('logistics', 'health', 'energy', 'education'))}."),)),
            ("Team", (_paragraph(rng, f"The project lead is {lead}."),)),
            ("Budget", (_paragraph(rng, f"Expenses for Project {project} must use the project code {code}."),)),
        )
        articles.append(Article(f"project-{project.lower()}", f"Project {project}", "project",
                                f"Project {project} is an internal project.", sections, {"code": code, "lead": lead}))
    return articles


def _messages(rng: random.Random, products: list[Product], articles: list[Article]) -> tuple[list[Message], dict]:
    messages, promos, counter = [], {}, [100]
    dates = [f"2026-{m:02d}-{d:02d}" for m in (9, 10, 11) for d in (3, 8, 12, 17, 21, 26)]

    def add(sender: str, subject: str, body: tuple[str, ...], facts: dict) -> None:
        counter[0] += rng.randint(1, 9)
        messages.append(Message(f"m{counter[0]}", sender, subject, rng.choice(dates), body, facts))

    brands = rng.sample(_BRANDS, 7)
    for i in range(7):
        code, percent = _code(rng, "SAVE-"), rng.choice((10, 15, 20, 25))
        promos[code] = percent
        sender = f"{brands[i]} Deals"
        add(sender, f"A {percent}% discount for you", (
            f"Dear customer, as a thank-you we are giving you {percent}% off your next order.",
            f"Enter the discount code {code} in the promo code field at checkout.",
            rng.choice(_FILLER) + " " + rng.choice(_FILLER)), {"kind": "promo", "code": code, "percent": percent,
                                                                "sender": sender})
    buildings = [a for a in articles if a.kind == "building"]
    people = rng.sample([f"{f} {l}" for f in _FIRST for l in _LAST], 7)
    for i in range(7):
        building = buildings[i % len(buildings)]
        room = list(building.facts["floors"])[rng.randrange(len(building.facts["floors"]))]
        time = f"{rng.randint(9, 16)}:{rng.choice(('00', '15', '30', '45'))}"
        sender, day = people[i], rng.choice(("Monday", "Tuesday", "Wednesday", "Thursday", "Friday"))
        add(sender, f"Planning meeting on {day}", (
            f"Hi, the planning meeting will be on {day} at {time}.",
            f"We will meet in room {room} in {building.title}.",
            rng.choice(_FILLER)), {"kind": "meeting", "room": room, "time": time, "day": day,
                                   "building": building.slug, "floor": building.facts["floors"][room],
                                   "sender": sender})
    for i in range(7):
        product = products[rng.randrange(len(products))]
        order = f"ORD-{rng.randint(100000, 999999)}"
        add("Shop Orders", f"Your order {order} has shipped", (
            f"Thank you for your order {order}.",
            f"Item: {product.name}, quantity 1, paid {product.price_text}.",
            "If something is wrong with your item, open a support ticket in Forms.", rng.choice(_FILLER)),
            {"kind": "order", "order": order, "sku": product.sku, "product": product.name})
    for i, event in enumerate(_EVENTS):
        ticket = _code(rng, "TKT-", 5)
        sender = f"{event} Team"
        add(sender, f"Your ticket for {event}", (
            f"You are invited to the {event}.",
            f"Your personal ticket code is {ticket}. You need it to register.",
            rng.choice(_FILLER)), {"kind": "ticket", "ticket": ticket, "event": event, "sender": sender})
    hotels = rng.sample(_CITIES, 7)
    for i in range(7):
        hotel = f"Hotel {hotels[i]}"
        amount, date = f"{rng.randint(80, 600)}.{rng.randint(0, 99):02d}", rng.choice(dates)
        add(hotel, "Your receipt", (
            f"Thank you for staying at {hotel}.",
            f"Total charged: {amount} USD on {date}.", rng.choice(_FILLER)),
            {"kind": "receipt", "amount": amount, "date": date, "hotel": hotel})
    order = list(range(len(messages)))
    rng.shuffle(order)
    return [messages[i] for i in order], promos


def _forms() -> list[FormSpec]:
    return [
        FormSpec("event", "Event registration", "Register for an event with your ticket code.",
                 (("name", "Full name"), ("email", "Email"), ("ticket", "Ticket code")),
                 (("event", "Event", _EVENTS),), (("vegetarian", "Vegetarian meal"), ("newsletter", "Newsletter"))),
        FormSpec("support", "Support ticket", "Report a problem with an order.",
                 (("order", "Order number"), ("sku", "Product SKU"), ("details", "Details")),
                 (("issue", "Issue", ("Damaged item", "Wrong item", "Missing parts", "Late delivery")),),
                 (("urgent", "Urgent"),)),
        FormSpec("expense", "Expense report", "Claim a business expense.",
                 (("amount", "Amount (USD)"), ("date", "Date"), ("project", "Project code"), ("note", "Note")),
                 (("category", "Category", ("Hotel", "Travel", "Meals", "Equipment")),), (("receipt", "Receipt attached"),)),
        FormSpec("address", "Address change", "Update the address we have on file.",
                 (("name", "Full name"), ("street", "Street"), ("city", "City"), ("zip", "ZIP code")),
                 (("reason", "Reason", ("Moved", "Correction", "Temporary")),), ()),
    ]


def make_world(seed: int = 0) -> World:
    """The whole text web for ``seed`` (same seed -> same world)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    rng = random.Random(seed)
    products = _products(rng)
    articles = _articles(rng)
    messages, promos = _messages(rng, products, articles)
    user = {"name": _person(rng), "street": f"{rng.randint(1, 99)} {rng.choice(_STREETS)}",
            "city": rng.choice(_CITIES), "zip": str(rng.randint(10000, 99999))}
    user["email"] = user["name"].lower().replace(" ", ".") + "@example.com"
    return World(seed, products, articles, messages, _forms(), promos, user)
