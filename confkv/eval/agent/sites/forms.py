"""The forms site: an index of forms, each form page, and a confirmation page after submitting."""

from __future__ import annotations

from confkv.eval.agent.page import Page
from confkv.eval.agent.sites.common import button, checkbox, heading, link, nav, radio, text, textbox
from confkv.eval.agent.state import BrowserState
from confkv.eval.agent.world import World


def build(world: World, state: BrowserState, path: str) -> Page | None:
    """Page for ``forms/<path>`` or None when there is no such page."""
    if path == "":
        body = [heading("Forms"), text("Choose a form:")]
        for spec in world.forms:
            body += [link(spec.title, f"forms/form/{spec.fid}"), text(spec.intro, depth=3)]
        return Page("forms/", "Forms", nav(), body)
    if path.startswith("form/"):
        fid = path.split("/", 1)[1]
        try:
            spec = world.form(fid)
        except StopIteration:
            return None
        f = state.fields
        body = [heading(spec.title), text(spec.intro)]
        body += [textbox(label, f"form:{fid}.{key}", f) for key, label in spec.fields]
        for group, label, options in spec.radios:
            body.append(text(label))
            body += [radio(o, f"form:{fid}.{group}", f, depth=3) for o in options]
        body += [checkbox(label, f"form:{fid}.{key}", f) for key, label in spec.checkboxes]
        body.append(button("Submit", f"submit:{fid}"))
        return Page(f"forms/{path}", f"Forms - {spec.title}", nav(), body)
    if path.startswith("done/"):
        fid = path.split("/", 1)[1]
        body = [heading("Form submitted"), text(f"Reference: F-{len(state.submitted):03d}"), link("All forms", "forms/")]
        return Page(f"forms/{path}", "Forms - Submitted", nav(), body)
    return None


def submit(world: World, state: BrowserState, fid: str) -> str:
    """The form's 'Submit': records every field (empty ones too) and returns the next url."""
    spec = world.form(fid)
    prefix = f"form:{fid}."
    values = {key: state.fields.get(prefix + key, "") for key, _ in spec.fields}
    values.update({group: state.fields.get(prefix + group, "") for group, _, _ in spec.radios})
    values.update({key: state.fields.get(prefix + key, "") == "on" for key, _ in spec.checkboxes})
    state.submitted.append({"form": fid, "values": values})
    for key in [k for k in state.fields if k.startswith(prefix)]:
        del state.fields[key]
    return f"forms/done/{fid}"
