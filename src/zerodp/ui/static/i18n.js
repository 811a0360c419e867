// zerodp ui: every word the page shows, in English and Chinese. Terms follow the guide's Chinese:
// 数据并行 (data parallelism), 分桶 (bucketing), 梯度累积 (gradient accumulation),
// 通信屋顶线 (communication roofline), 显存 (GPU memory), 优化器状态, 激活值, 重计算, 微批次.
"use strict";

// The words are data: i18n.json beside this file, {"en": {key: text}, "zh": {key: text}}.
let I18N = { en: {}, zh: {} };

// Read the words once, before the page shows anything (app.js main() awaits it).
async function loadWords() {
  const res = await fetch("/static/i18n.json");
  if (!res.ok) throw new Error(`/static/i18n.json: HTTP ${res.status}`);
  I18N = await res.json();
}

// The page's language: ?lang=zh or ?lang=en in the URL (default English).
function pageLang() {
  const lang = new URLSearchParams(location.search).get("lang");
  return lang === "zh" ? "zh" : "en";
}

// t("overlap.lanes", {model: ...}): the text in the page's language, {names} filled in.
function t(key, vars) {
  const table = I18N[pageLang()];
  let text = key in table ? table[key] : I18N.en[key];
  if (text === undefined) text = key;
  for (const [k, v] of Object.entries(vars || {})) text = text.replace(`{${k}}`, v);
  return text;
}

function applyLang() {
  const lang = pageLang();
  document.documentElement.lang = lang === "zh" ? "zh-CN" : "en";
  document.title = t("page.title");
  for (const el of document.querySelectorAll("[data-i18n]")) el.textContent = t(el.dataset.i18n);
  for (const el of document.querySelectorAll("[data-i18n-aria]")) {
    el.setAttribute("aria-label", t(el.dataset.i18nAria));
  }
  for (const el of document.querySelectorAll("[data-i18n-placeholder]")) {
    el.placeholder = t(el.dataset.i18nPlaceholder);
  }
  for (const a of document.querySelectorAll("[data-lang]")) {
    a.setAttribute("aria-current", a.dataset.lang === lang ? "true" : "false");
  }
}
