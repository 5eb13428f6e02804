/* Behaviour shared by every page: drawers, confirmations, copy buttons, toasts. No inline JS. */
(function () {
  "use strict";

  const body = document.body;

  // Forms with data-confirm ask first (deleting a conversation, revoking a key).
  document.addEventListener("submit", (event) => {
    const form = event.target;
    const question = form.getAttribute && form.getAttribute("data-confirm");
    if (question && !window.confirm(question)) event.preventDefault();
  }, true);

  // Copy buttons: data-copy-target="<input id>".
  document.addEventListener("click", (event) => {
    const button = event.target.closest("[data-copy-target]");
    if (!button) return;
    const input = document.getElementById(button.getAttribute("data-copy-target"));
    if (!input) return;
    window.clawCopy(input.value).then(() => {
      const label = button.textContent;
      button.textContent = "Copied";
      setTimeout(() => { button.textContent = label; }, 1500);
    });
  });

  window.clawCopy = function (text) {
    if (navigator.clipboard && window.isSecureContext) {
      return navigator.clipboard.writeText(text).catch(() => legacyCopy(text));
    }
    return Promise.resolve(legacyCopy(text));
  };

  function legacyCopy(text) {
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    try { document.execCommand("copy"); } catch (e) { /* nothing more to try */ }
    area.remove();
  }

  // Server-rendered toasts fade away on their own.
  document.querySelectorAll(".toasts .toast").forEach((toast) => {
    setTimeout(() => toast.remove(), 6000);
  });

  // Conversation sidebar: a drawer on phones.
  const sidebarToggle = document.querySelector(".sidebar-toggle");
  const backdrop = document.querySelector(".sidebar-backdrop");
  function setSidebar(open) {
    body.classList.toggle("sidebar-open", open);
    if (sidebarToggle) {
      sidebarToggle.setAttribute("aria-expanded", String(open));
      sidebarToggle.setAttribute("aria-label", open ? "Hide conversations" : "Show conversations");
    }
    if (backdrop) backdrop.hidden = !open;
  }
  if (sidebarToggle) sidebarToggle.addEventListener("click", () => setSidebar(!body.classList.contains("sidebar-open")));
  if (backdrop) backdrop.addEventListener("click", () => setSidebar(false));

  // Personalization panel: a column on wide screens, a drawer otherwise; remembered.
  const panelToggle = document.querySelector(".panel-toggle");
  const panelClose = document.querySelector(".panel-close");
  const wide = window.matchMedia("(min-width: 1101px)");
  function setPanel(open, remember) {
    body.classList.toggle("panel-open", open);
    if (panelToggle) panelToggle.setAttribute("aria-expanded", String(open));
    if (remember) {
      try { localStorage.setItem("claw:panel", open ? "open" : "closed"); } catch (e) { /* private mode */ }
    }
  }
  if (panelToggle) {
    let saved = null;
    try { saved = localStorage.getItem("claw:panel"); } catch (e) { /* private mode */ }
    setPanel(wide.matches && saved !== "closed", false);
    panelToggle.addEventListener("click", () => setPanel(!body.classList.contains("panel-open"), true));
  }
  if (panelClose) panelClose.addEventListener("click", () => { setPanel(false, true); if (panelToggle) panelToggle.focus(); });

  document.addEventListener("keydown", (event) => {
    if (event.key !== "Escape") return;
    if (body.classList.contains("sidebar-open")) setSidebar(false);
    document.querySelectorAll("details.menu[open]").forEach((d) => d.removeAttribute("open"));
  });
})();
