// Drives the chat page's script (cipherlm/runtime/proxy_static/index.html) under Node with a
// minimal DOM stand-in against a running proxy: types a prompt, submits, waits for the streamed
// reply, prints the final DOM state as JSON. Used by tests/test_proxy.py (skipped without node).
"use strict";
const fs = require("fs");
const [, , pagePath, baseUrl, promptText, maxTokens, compare] = process.argv;
const html = fs.readFileSync(pagePath, "utf8");
const script = html.match(/<script>([\s\S]*)<\/script>/)[1];

class El {
  constructor(tag, id) { this.tagName = tag; this.id = id || ""; this.children = []; this._text = "";
    this.className = ""; this.attrs = {}; this.listeners = {}; this.value = ""; this.disabled = false; }
  get textContent() { return this._text + this.children.map((c) => c.textContent).join(""); }
  set textContent(t) { this._text = String(t); this.children = []; }
  get classList() { const self = this; return {
    add(c) { if (!self.className.split(" ").includes(c)) self.className = (self.className + " " + c).trim(); },
    remove(c) { self.className = self.className.split(" ").filter((x) => x && x !== c).join(" "); } }; }
  get options() { return this.children.filter((c) => c.tagName === "option"); }
  appendChild(c) { this.children.push(c); if (this.tagName === "select" && !this.value) this.value = c.value; return c; }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  getAttribute(k) { return this.attrs[k]; }
  addEventListener(t, f) { (this.listeners[t] = this.listeners[t] || []).push(f); }
  dispatch(t, ev) { for (const f of this.listeners[t] || []) f(ev); }
  requestSubmit() { this.dispatch("submit", {preventDefault() {}}); }
  scrollIntoView() {} focus() {}
  all() { return [this].concat(...this.children.map((c) => c.all())); }
}
const ids = {};
for (const m of html.matchAll(/<(\w+)[^>]*\bid="([^"]+)"/g)) ids[m[2]] = new El(m[1], m[2]);
for (const m of html.matchAll(/<input[^>]*\bid="([^"]+)"[^>]*\bvalue="([^"]*)"/g)) ids[m[1]].value = m[2];
global.document = { getElementById: (id) => ids[id], createElement: (t) => new El(t) };
const realFetch = fetch;
global.fetch = (url, opts) => realFetch(baseUrl + url, opts);
eval(script);

(async () => {
  const deadline = Date.now() + 120000;
  while (!ids.model.options.length) { if (Date.now() > deadline) throw new Error("no models"); await new Promise((r) => setTimeout(r, 50)); }
  ids.prompt.value = promptText;
  if (maxTokens) ids.maxtokens.value = maxTokens;
  if (compare) { if (ids.cmpwrap.hidden) throw new Error("no compare box"); ids.compare.checked = true; }
  ids.form.dispatch("submit", {preventDefault() {}});
  let reply;
  while (!(reply = ids.log.all().find((e) => e.attrs["data-done"] === "1"))) {
    if (Date.now() > deadline) throw new Error("no reply");
    await new Promise((r) => setTimeout(r, 50));
  }
  const cost = ids.log.all().find((e) => e.tagName === "aside");
  console.log(JSON.stringify({reply: reply.textContent, replyClass: reply.className, cost: cost.textContent,
                              status: ids.status.textContent, compareShown: !ids.cmpwrap.hidden, models: ids.model.options.map((o) => o.value)}));
})().catch((e) => { console.error(String(e)); process.exit(1); });
