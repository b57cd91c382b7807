"""The task suite: templates x variants over one seeded world, each with a checker and an expert plan.

Eight templates, seven variants each (56 tasks). Every task has a programmatic success
check (the final answer, or the cart / order / sent mail / submitted form) and an expert
plan that :func:`confkv.eval.agent.expert.run_plan` turns into 15-40 actions. Templates marked
``info_early`` need a code, price or name read in the first few steps much later
(e.g. a discount code read in an email at step 2 and typed at checkout at step ~22).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from confkv.eval.agent.sites.shop import cart_total
from confkv.eval.agent.state import BrowserState
from confkv.eval.agent.world import CATEGORIES, World

VARIANTS = 7


@dataclass
class Task:
    tid: str  # "<template>-<variant>"
    template: str
    goal: str
    start_url: str
    plan: list[tuple]
    check: Callable[[BrowserState], bool] = field(repr=False)
    info_early: bool = False
    cart: dict[str, int] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)  # what the checker expects (for records)


def _norm(text: str | None) -> str:
    text = (text or "").lower().replace("$", "").replace(",", "")
    return re.sub(r"\s+", " ", re.sub(r"[\"'`]", "", text)).strip()


def answer_has(state: BrowserState, *needles: str) -> bool:
    """The stop answer contains every needle (case, quotes, $ and thousands commas ignored)."""
    answer = _norm(state.answer)
    return state.done and all(_norm(n) in answer for n in needles)


def _address_plan(user: dict) -> list[tuple]:
    return [("type", "textbox", "Full name", user["name"]), ("type", "textbox", "Street", user["street"]),
            ("type", "textbox", "City", user["city"]), ("type", "textbox", "ZIP code", user["zip"])]


def _address_ok(order: dict, user: dict) -> bool:
    return all(_norm(order.get(k)) == _norm(user[k]) for k in ("name", "street", "city", "zip"))


def _address_text(user: dict) -> str:
    return f"{user['name']}, {user['street']}, {user['city']} {user['zip']}"


def _inbox_link(world: World, mid: str) -> tuple:
    m = world.message(mid)
    return ("click", "link", f"{m.sender}: {m.subject}")


def _search_words(name: str) -> str:
    return " ".join(name.split()[:3])  # brand model number: unique enough, and what a person types


def shop_cheapest(world: World, i: int, rng: random.Random) -> Task:
    category = CATEGORIES[i % len(CATEGORIES)]
    picks = rng.sample(world.products_in(category), 3)
    cheapest = min(picks, key=lambda p: p.price)
    user = world.user
    goal = (f"In the {category} department, compare the {picks[0].name}, the {picks[1].name} and the "
            f"{picks[2].name}. Buy the cheapest of the three (quantity 1) with standard shipping to "
            f"{_address_text(user)}.")
    plan: list[tuple] = [("click", "link", category)]
    for p in picks:
        plan += [("click", "link", p.name), ("see", "Price:"), ("back",)]
    plan += [("click", "link", cheapest.name), ("click", "button", "Add to cart"), ("click", "link", "Cart"),
             ("click", "button", "Proceed to checkout")] + _address_plan(user)
    plan += [("click", "radio", "Standard shipping"), ("click", "button", "Place order"), ("stop", "")]

    def check(s: BrowserState) -> bool:
        return bool(s.orders) and s.orders[-1]["items"] == {cheapest.sku: 1} and _address_ok(s.orders[-1], user) \
            and s.orders[-1]["shipping"] == "Standard shipping"
    return Task(f"shop_cheapest-{i}", "shop_cheapest", goal, "shop/", plan, check, False,
                facts={"sku": cheapest.sku})


def promo_purchase(world: World, i: int, rng: random.Random) -> Task:
    promo = world.messages_of("promo")[i]
    category = CATEGORIES[(i + 2) % len(CATEGORIES)]
    x, y = rng.sample(world.products_in(category), 2)
    cheaper, qty, user = min((x, y), key=lambda p: p.price), 2, world.user
    goal = (f"The email from {promo.facts['sender']} has a discount code. Compare the {x.name} and the {y.name}, "
            f"then buy {qty} of the cheaper one using that code, with express shipping to {_address_text(user)}.")
    plan: list[tuple] = [_inbox_link(world, promo.mid), ("see", "discount code"), ("click", "link", "Shop")]
    for p in (x, y):
        plan += [("type", "searchbox", "Search products", _search_words(p.name)), ("click", "link", p.name),
                 ("see", "Price:")]
    plan += [("type", "searchbox", "Search products", _search_words(cheaper.name)), ("click", "link", cheaper.name),
             ("type", "textbox", "Quantity", str(qty)), ("click", "button", "Add to cart"), ("click", "link", "Cart"),
             ("click", "button", "Proceed to checkout")] + _address_plan(user)
    plan += [("click", "radio", "Express shipping"), ("type", "textbox", "Promo code", promo.facts["code"]),
             ("click", "button", "Place order"), ("stop", "")]

    def check(s: BrowserState) -> bool:
        return bool(s.orders) and s.orders[-1]["items"] == {cheaper.sku: qty} and _address_ok(s.orders[-1], user) \
            and s.orders[-1]["promo"] == promo.facts["code"] and s.orders[-1]["shipping"] == "Express shipping"
    return Task(f"promo_purchase-{i}", "promo_purchase", goal, "mail/", plan, check, True,
                facts={"code": promo.facts["code"], "sku": cheaper.sku})


def cart_total_task(world: World, i: int, rng: random.Random) -> Task:
    old, a, b, c = rng.sample(world.products, 4)
    qa, qb = rng.randint(2, 4), rng.randint(2, 3)
    want = {a.sku: qa, b.sku: qb, c.sku: 1}
    total = f"{cart_total(world, want):.2f}"
    goal = (f"Your cart holds the {old.name}. Remove it, then add {qa} x {a.name}, {qb} x {b.name} and 1 x {c.name} "
            f"(use the search) and answer with the cart total.")
    plan: list[tuple] = [("click", "link", "Cart"), ("click", "button", f"Remove {old.name}")]
    for p, q in ((a, qa), (b, qb), (c, 1)):
        plan += [("type", "searchbox", "Search products", _search_words(p.name)), ("click", "link", p.name)]
        if q != 1:
            plan.append(("type", "textbox", "Quantity", str(q)))
        plan.append(("click", "button", "Add to cart"))
    plan += [("click", "link", "Cart"), ("see", "Total:"), ("stop", f"${total}")]

    def check(s: BrowserState) -> bool:
        return s.cart == want and answer_has(s, total)
    return Task(f"cart_total-{i}", "cart_total", goal, "shop/", plan, check, False, cart={old.sku: 1},
                facts={"total": total})


def wiki_earliest(world: World, i: int, rng: random.Random) -> Task:
    cities = rng.sample(world.articles_of("city"), 5)
    first = min(cities, key=lambda a: a.facts["founded"])
    names = [c.title for c in cities]
    goal = (f"Which of {', '.join(names[:-1])} and {names[-1]} was founded earliest? Use the wiki and answer with the "
            f"city's name and its founding year.")
    plan: list[tuple] = []
    for c in cities:
        plan += [("type", "searchbox", "Search wiki", c.title), ("click", "link", c.title), ("see", "was founded in")]
    plan.append(("stop", f"{first.title}, {first.facts['founded']}"))

    def check(s: BrowserState) -> bool:
        return answer_has(s, first.title, str(first.facts["founded"]))
    return Task(f"wiki_earliest-{i}", "wiki_earliest", goal, "wiki/", plan, check, False,
                facts={"city": first.title, "year": first.facts["founded"]})


def meeting_forward(world: World, i: int, rng: random.Random) -> Task:
    meeting = world.messages_of("meeting")[i]
    f = meeting.facts
    building = world.article(f["building"])
    project = world.articles_of("project")[i % len(world.articles_of("project"))]
    lead = project.facts["lead"]
    city = world.articles_of("city")[i]
    mayor = city.facts["mayor"]
    to = rng.choice(["ops", "team", "desk", "office"]) + f"{i}@example.com"
    body = f"{f['day']} {f['time']}, room {f['room']}, floor {f['floor']}, lead {lead}, guest {mayor}"
    goal = (f"Read the email from {f['sender']} about the planning meeting. Find the floor of its room in the wiki "
            f"article on the building, and who leads {project.title} (wiki). Then email {to} with subject "
            f"'Planning meeting' giving the day, time, room, floor, the project lead and, as guest, the mayor of "
            f"{city.title} (wiki).")
    plan = [_inbox_link(world, meeting.mid), ("see", "We will meet in room"), ("click", "link", "Wiki"),
            ("type", "searchbox", "Search wiki", building.title), ("click", "link", building.title),
            ("see", f"Room {f['room']} is on floor"), ("type", "searchbox", "Search wiki", project.title),
            ("click", "link", project.title), ("see", "The project lead is"),
            ("type", "searchbox", "Search wiki", city.title), ("click", "link", city.title),
            ("see", "The current mayor is"), ("click", "link", "Mail"),
            ("click", "link", "Compose"), ("type", "textbox", "To", to), ("type", "textbox", "Subject",
                                                                           "Planning meeting"),
            ("type", "textbox", "Message", body), ("click", "button", "Send"), ("stop", "")]

    def check(s: BrowserState) -> bool:
        return any(_norm(m["to"]) == to and "planning meeting" in _norm(m["subject"])
                   and all(_norm(x) in _norm(m["body"]) for x in (f["day"], f["time"], f["room"], lead, mayor))
                   and re.search(rf"floor\D{{0,3}}{f['floor']}\b", _norm(m["body"])) for m in s.sent)
    return Task(f"meeting_forward-{i}", "meeting_forward", goal, "mail/", plan, check, True,
                facts={"room": f["room"], "floor": f["floor"], "time": f["time"], "lead": lead, "mayor": mayor})


def event_register(world: World, i: int, rng: random.Random) -> Task:
    tickets = world.messages_of("ticket")
    t1, t2 = tickets[i], tickets[(i + 3) % len(tickets)]
    user = world.user
    goal = (f"Register for the {t1.facts['event']} and for the {t2.facts['event']} (one Event registration form "
            f"each) using the ticket codes from your emails, with name {user['name']} and email {user['email']}. "
            f"Ask for a vegetarian meal at the {t1.facts['event']} only.")
    plan: list[tuple] = [_inbox_link(world, t1.mid), ("see", "ticket code"), ("back",), _inbox_link(world, t2.mid),
                         ("see", "ticket code"), ("click", "link", "Forms")]
    for n, (t, veg) in enumerate(((t1, True), (t2, False))):
        if n:
            plan.append(("click", "link", "All forms"))
        plan += [("click", "link", "Event registration"), ("type", "textbox", "Full name", user["name"]),
                 ("type", "textbox", "Email", user["email"]), ("type", "textbox", "Ticket code", t.facts["ticket"]),
                 ("click", "radio", t.facts["event"])]
        if veg:
            plan.append(("click", "checkbox", "Vegetarian meal"))
        plan.append(("click", "button", "Submit"))
    plan.append(("stop", ""))

    def one(s: BrowserState, t, veg: bool) -> bool:
        return any(x["form"] == "event" and x["values"]["ticket"].strip() == t.facts["ticket"]
                   and x["values"]["event"] == t.facts["event"] and x["values"]["vegetarian"] == veg
                   and _norm(x["values"]["name"]) == _norm(user["name"])
                   and _norm(x["values"]["email"]) == _norm(user["email"]) for x in s.submitted)

    def check(s: BrowserState) -> bool:
        return one(s, t1, True) and one(s, t2, False)
    return Task(f"event_register-{i}", "event_register", goal, "mail/", plan, check, True,
                facts={"tickets": [t1.facts["ticket"], t2.facts["ticket"]]})


def support_ticket(world: World, i: int, rng: random.Random) -> Task:
    order = world.messages_of("order")[i]
    product = world.product(order.facts["sku"])
    department = world.products_in(product.category)
    cheapest = min(department, key=lambda p: p.price)
    goal = (f"The item of order {order.subject.split()[2]} arrived damaged. Open an urgent Support ticket with the "
            f"order number, the product's SKU (see its shop page), issue 'Damaged item' and details 'Arrived "
            f"damaged'. Then answer with the name of the cheapest product in the item's shop department.")
    plan = [_inbox_link(world, order.mid), ("see", "Item:"), ("click", "link", "Shop"),
            ("type", "searchbox", "Search products", _search_words(product.name)), ("click", "link", product.name),
            ("see", "SKU:"), ("click", "link", "Forms"), ("click", "link", "Support ticket"),
            ("type", "textbox", "Order number", order.facts["order"]), ("type", "textbox", "Product SKU", product.sku),
            ("type", "textbox", "Details", "Arrived damaged"), ("click", "radio", "Damaged item"),
            ("click", "checkbox", "Urgent"), ("click", "button", "Submit"), ("click", "link", "Shop"),
            ("click", "link", product.category), ("see", department[-1].name), ("stop", cheapest.name)]

    def check(s: BrowserState) -> bool:
        return answer_has(s, cheapest.name) and any(
            x["form"] == "support" and x["values"]["order"].strip() == order.facts["order"]
            and x["values"]["sku"].strip() == product.sku and x["values"]["issue"] == "Damaged item"
            and x["values"]["urgent"] for x in s.submitted)
    return Task(f"support_ticket-{i}", "support_ticket", goal, "mail/", plan, check, True,
                facts={"order": order.facts["order"], "sku": product.sku, "cheapest": cheapest.name})


def expense_report(world: World, i: int, rng: random.Random) -> Task:
    receipt = world.messages_of("receipt")[i]
    project = world.articles_of("project")[(i + 2) % len(world.articles_of("project"))]
    f, code, lead = receipt.facts, project.facts["code"], project.facts["lead"]
    note = f"Hotel stay, approved by {lead}"
    goal = (f"File an Expense report for the receipt from {f['hotel']}: amount and date from the email, category "
            f"Hotel, receipt attached, the project code of {project.title} (wiki) and the note 'Hotel stay, "
            f"approved by <the project lead>'.")
    plan = [_inbox_link(world, receipt.mid), ("see", "Total charged"), ("click", "link", "Wiki"),
            ("type", "searchbox", "Search wiki", project.title), ("click", "link", project.title),
            ("see", "The project lead is"), ("see", "project code"), ("click", "link", "Forms"),
            ("click", "link", "Expense report"), ("type", "textbox", "Amount (USD)", f["amount"]),
            ("type", "textbox", "Date", f["date"]), ("type", "textbox", "Project code", code),
            ("type", "textbox", "Note", note), ("click", "radio", "Hotel"), ("click", "checkbox", "Receipt attached"),
            ("click", "button", "Submit"), ("stop", "")]

    def check(s: BrowserState) -> bool:
        return any(x["form"] == "expense" and x["values"]["amount"].strip().lstrip("$") == f["amount"]
                   and x["values"]["date"].strip() == f["date"] and x["values"]["project"].strip() == code
                   and _norm(lead) in _norm(x["values"]["note"]) and x["values"]["category"] == "Hotel"
                   and x["values"]["receipt"] for x in s.submitted)
    return Task(f"expense_report-{i}", "expense_report", goal, "mail/", plan, check, True,
                facts={"amount": f["amount"], "date": f["date"], "code": code})


TEMPLATES: dict[str, Callable[[World, int, random.Random], Task]] = {
    "shop_cheapest": shop_cheapest, "promo_purchase": promo_purchase, "cart_total": cart_total_task,
    "wiki_earliest": wiki_earliest, "meeting_forward": meeting_forward, "event_register": event_register,
    "support_ticket": support_ticket, "expense_report": expense_report,
}


def build_tasks(world: World) -> list[Task]:
    """All tasks of ``world`` (templates x :data:`VARIANTS`), deterministic in the world's seed."""
    tasks = []
    for t_index, (name, make) in enumerate(TEMPLATES.items()):
        for i in range(VARIANTS):
            tasks.append(make(world, i, random.Random(world.seed * 1000 + t_index * 100 + i)))
    return tasks
