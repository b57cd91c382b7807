"""The shop: home (categories), category listings, search, product pages, cart, checkout, order page."""

from __future__ import annotations

from confkv.eval.agent.page import Element, Page
from confkv.eval.agent.sites.common import button, heading, link, nav, radio, text, textbox
from confkv.eval.agent.state import BrowserState
from confkv.eval.agent.world import CATEGORIES, World

SHIPPING = ("Standard shipping", "Express shipping", "Store pickup")
CHECKOUT_FIELDS = (("name", "Full name"), ("street", "Street"), ("city", "City"), ("zip", "ZIP code"),
                   ("promo", "Promo code"))


def _header(state: BrowserState) -> list[Element]:
    count = sum(state.cart.values())
    return nav([Element("searchbox", "Search products", target="search:shop", depth=1),
                link("Cart", "shop/cart", depth=1), text(f"{count} items in cart", depth=1)])


def _listing(world: World, products: list) -> list[Element]:
    body = []
    for product in products:
        body.append(link(product.name, f"shop/product/{product.sku}"))
        body.append(text(f"{product.price_text} | rating {product.rating} | {product.stock} in stock", depth=3))
    return body


def cart_total(world: World, cart: dict[str, int]) -> float:
    return round(sum(world.product(sku).price * qty for sku, qty in cart.items()), 2)


def build(world: World, state: BrowserState, path: str) -> Page | None:
    """Page for ``shop/<path>`` or None when there is no such page."""
    header, f = _header(state), state.fields
    if path == "":
        body = [heading("Welcome to the shop"), text("Browse our departments:")]
        body += [link(c, f"shop/category/{c.lower()}") for c in CATEGORIES]
        body += [heading("Featured")] + _listing(world, world.products[3::12])
        return Page("shop/", "Shop - Home", header, body)
    if path.startswith("category/"):
        name = path.split("/", 1)[1]
        matches = [c for c in CATEGORIES if c.lower() == name]
        if not matches:
            return None
        products = world.products_in(matches[0])
        return Page(f"shop/{path}", f"Shop - {matches[0]}", header,
                    [heading(matches[0]), text(f"{len(products)} products")] + _listing(world, products))
    if path.startswith("search?q="):
        query = path.split("=", 1)[1]
        words = query.lower().split()
        found = [p for p in world.products if words and all(w in p.name.lower() for w in words)]
        body = [heading(f"Search results for '{query}'"), text(f"{len(found)} results")] + _listing(world, found)
        return Page(f"shop/{path}", "Shop - Search", header, body)
    if path.startswith("product/"):
        sku = path.split("/", 1)[1]
        try:
            product = world.product(sku)
        except StopIteration:
            return None
        body = [heading(product.name), text(f"Price: {product.price_text}"), text(f"SKU: {product.sku}"),
                text(f"Rating: {product.rating} out of 5"), text(f"In stock: {product.stock}"),
                textbox("Quantity", f"product:{sku}.qty", f), button("Add to cart", f"add:{sku}"),
                heading("Description"), text(product.description), heading("Specifications")]
        body += [text(f"{k}: {v}", depth=3) for k, v in product.specs]
        body += [link(f"More {product.category}", f"shop/category/{product.category.lower()}")]
        return Page(f"shop/{path}", f"Shop - {product.name}", header, body)
    if path == "cart":
        body = [heading("Shopping cart")]
        for sku, qty in state.cart.items():
            product = world.product(sku)
            body += [link(product.name, f"shop/product/{sku}"),
                     text(f"Quantity {qty} | {product.price_text} each", depth=3), button(f"Remove {product.name}",
                                                                                          f"remove:{sku}", depth=3)]
        if not state.cart:
            body.append(text("Your cart is empty."))
        body += [text(f"Total: ${cart_total(world, state.cart):.2f}"), button("Proceed to checkout", "url:shop/checkout")]
        return Page("shop/cart", "Shop - Cart", header, body)
    if path == "checkout":
        body = [heading("Checkout"), text(f"Order total: ${cart_total(world, state.cart):.2f}"), heading("Address")]
        body += [textbox(label, f"checkout.{key}", f) for key, label in CHECKOUT_FIELDS[:4]]
        body += [heading("Delivery")] + [radio(s, "checkout.shipping", f) for s in SHIPPING]
        body += [heading("Discount"), textbox("Promo code", "checkout.promo", f), button("Place order", "order")]
        return Page("shop/checkout", "Shop - Checkout", header, body)
    if path.startswith("order/"):
        number = path.split("/", 1)[1]
        order = next((o for o in state.orders if o["number"] == number), None)
        if order is None:
            return None
        body = [heading("Thank you for your order"), text(f"Order number: {number}")]
        body += [text(f"{world.product(s).name} x {q}") for s, q in order["items"].items()]
        body += [text(f"Paid: ${order['paid']:.2f}"), link("Continue shopping", "shop/")]
        return Page(f"shop/{path}", "Shop - Order placed", header, body)
    return None


def place_order(world: World, state: BrowserState) -> str:
    """The checkout's 'Place order': records the order and returns the next url (or sets a notice)."""
    f = state.fields
    missing = [label for key, label in CHECKOUT_FIELDS[:4] if not f.get(f"checkout.{key}")]
    if not state.cart:
        state.notice = "Your cart is empty."
        return state.url
    if missing or not f.get("checkout.shipping"):
        state.notice = "Please fill in: " + ", ".join(missing + ([] if f.get("checkout.shipping") else ["Delivery"]))
        return state.url
    promo = f.get("checkout.promo", "").strip()
    percent = world.promos.get(promo, 0)
    total = cart_total(world, state.cart)
    number = f"W{world.seed % 100:02d}{len(state.orders) + 1:04d}"
    state.orders.append({"number": number, "items": dict(state.cart), "promo": promo, "percent": percent,
                         "paid": round(total * (100 - percent) / 100, 2),
                         **{key: f.get(f"checkout.{key}", "") for key, _ in CHECKOUT_FIELDS[:4]},
                         "shipping": f.get("checkout.shipping", "")})
    state.cart = {}
    for key in [k for k in f if k.startswith("checkout.")]:
        del f[key]
    return f"shop/order/{number}"
