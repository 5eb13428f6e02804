/* The chat page: renders the conversation tree, streams replies over /ws/chat/, sends feedback.
 *
 * The server renders the shown branch; on load this script re-renders it from the same data
 * (the #chat-data json_script) and takes over. Protocol: docs/CONTRACTS.md and docs/websocket.md.
 * User text is only ever set with textContent; assistant markdown goes through DOMPurify.
 */
(function () {
  "use strict";

  const data = JSON.parse(document.getElementById("chat-data").textContent);
  const csrfToken = document.querySelector('meta[name="csrf-token"]').content;
  const messagesEl = document.getElementById("messages");
  const listEl = document.getElementById("messages-inner");
  const form = document.getElementById("composer");
  const input = document.getElementById("composer-input");
  const sendBtn = document.getElementById("send-btn");
  const stopBtn = document.getElementById("stop-btn");
  const connEl = document.getElementById("conn-status");
  const titleEl = document.getElementById("conversation-title");
  const toastRegion = document.getElementById("toast-region");

  const TERMINAL_JOB_STATES = new Set([
    "done", "succeeded", "success", "completed", "finished", "published", "failed", "error",
    "cancelled", "canceled", "rejected", "rolled_back", "skipped",
  ]);

  const state = {
    conversationId: data.conversation_id,
    agentId: data.agent_id,
    title: data.conversation_title || "",
    turns: new Map(),       // id -> turn payload (+ feedback)
    chosen: new Map(),      // parent key -> child id picked with "< 1/2 >"
    streaming: new Set(),   // assistant turn ids still streaming
    pendingSend: null,      // {requestId, content} until message.saved or error
    socket: null,
    outbox: [],
    retryDelay: 500,
    openEditor: null,       // {turnId, kind}
  };
  for (const turn of data.turns) state.turns.set(turn.id, turn);

  // ---------------------------------------------------------------- markdown

  let purifyConfigured = false;
  function renderMarkdown(el, text) {
    if (!window.marked || !window.DOMPurify) {  // vendor scripts missing: plain text, still safe
      el.textContent = text;
      el.style.whiteSpace = "pre-wrap";
      return;
    }
    if (!purifyConfigured) {
      window.DOMPurify.addHook("afterSanitizeAttributes", (node) => {
        if (node.tagName === "A") {
          node.setAttribute("target", "_blank");
          node.setAttribute("rel", "noopener noreferrer nofollow");
        }
      });
      purifyConfigured = true;
    }
    const html = window.marked.parse(text || "", { gfm: true, breaks: true, async: false });
    el.innerHTML = window.DOMPurify.sanitize(html, {
      USE_PROFILE: { html: true },
      // Images from model output could leak data to other hosts; forms and styles have no use here.
      FORBID_TAGS: ["img", "style", "form", "input", "button", "textarea", "select", "iframe", "svg", "math"],
      FORBID_ATTR: ["style", "srcset"],
    });
    el.querySelectorAll("pre > code").forEach(decorateCode);
  }

  function decorateCode(code) {
    const pre = code.parentElement;
    const match = /language-([\w+-]+)/.exec(code.className || "");
    if (window.hljs) {
      try {
        if (match && window.hljs.getLanguage(match[1])) {
          code.innerHTML = window.hljs.highlight(code.textContent, { language: match[1], ignoreIllegals: true }).value;
          code.classList.add("hljs");
        } else {
          window.hljs.highlightElement(code);
        }
      } catch (e) { /* leave it plain */ }
    }
    const wrap = document.createElement("div");
    wrap.className = "code-block";
    const head = document.createElement("div");
    head.className = "code-block-head";
    const lang = document.createElement("span");
    lang.textContent = match ? match[1] : "code";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "btn btn-ghost btn-sm";
    copy.textContent = "Copy";
    copy.setAttribute("aria-label", "Copy code");
    copy.addEventListener("click", () => {
      window.clawCopy(code.textContent).then(() => flash(copy, "Copied"));
    });
    head.append(lang, copy);
    pre.replaceWith(wrap);
    wrap.append(head, pre);
  }

  function flash(button, text) {
    const old = button.textContent;
    button.textContent = text;
    setTimeout(() => { button.textContent = old; }, 1400);
  }

  // ---------------------------------------------------------------- the turn tree

  const keyOf = (parentId) => (parentId == null ? "root" : String(parentId));

  function childrenOf(parentId) {
    const kids = [];
    for (const turn of state.turns.values()) if (keyOf(turn.parent_id) === keyOf(parentId)) kids.push(turn);
    kids.sort((a, b) => (a.created_at < b.created_at ? -1 : a.created_at > b.created_at ? 1 : a.id - b.id));
    return kids;
  }

  function latest(kids) {
    // Same rule as services.shown_branch: the main line wins over side turns.
    const main = kids.filter((t) => (t.turn_type || "main") === "main");
    const pool = main.length ? main : kids;
    return pool[pool.length - 1];
  }

  function shownBranch() {
    const branch = [];
    let parentId = null;
    for (;;) {
      const kids = childrenOf(parentId);
      if (!kids.length) break;
      const picked = state.chosen.get(keyOf(parentId));
      const turn = kids.find((t) => t.id === picked) || latest(kids);
      branch.push({ turn, siblings: kids });
      parentId = turn.id;
    }
    return branch;
  }

  // Show the branch that goes through `turn` (a new message or reply, or a picked sibling).
  function showThrough(turn) {
    let node = turn;
    while (node) {
      state.chosen.set(keyOf(node.parent_id), node.id);
      node = node.parent_id == null ? null : state.turns.get(node.parent_id);
    }
  }

  function versionOf(turn) {
    return turn.version_label || turn.version || "base";
  }

  // ---------------------------------------------------------------- rendering

  function icon(name) {
    const paths = {
      copy: '<rect x="9" y="9" width="11" height="11" rx="2"/><path d="M5 15V5a2 2 0 0 1 2-2h8"/>',
      up: '<path d="M7 10v11H4V10zM7 10l4-7a2 2 0 0 1 3 2l-1 5h6a2 2 0 0 1 2 2.3l-1.3 7A2 2 0 0 1 17.7 21H7"/>',
      down: '<path d="M17 14V3h3v11zM17 14l-4 7a2 2 0 0 1-3-2l1-5H5a2 2 0 0 1-2-2.3l1.3-7A2 2 0 0 1 6.3 3H17"/>',
      edit: '<path d="M4 20h4L19 9l-4-4L4 16z"/><path d="M14 6l4 4"/>',
      regen: '<path d="M20 11a8 8 0 1 0-2.3 5.7"/><path d="M20 4v7h-7"/>',
      prev: '<path d="M15 6l-6 6 6 6"/>',
      next: '<path d="M9 6l6 6-6 6"/>',
    };
    return '<svg viewBox="0 0 24 24" fill="none" stroke="currentColor" stroke-width="2" stroke-linecap="round" stroke-linejoin="round" aria-hidden="true">' + paths[name] + "</svg>";
  }

  function iconButton(action, label, iconName, pressed) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "icon-btn";
    b.dataset.action = action;
    b.setAttribute("aria-label", label);
    b.title = label;
    if (pressed !== undefined) b.setAttribute("aria-pressed", String(!!pressed));
    b.innerHTML = icon(iconName);  // static SVG only, never user content
    return b;
  }

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function renderAll() {
    const branch = shownBranch().filter((entry) => entry.turn.role !== "system");
    listEl.replaceChildren();
    if (!branch.length) {
      const empty = el("div", "empty-chat");
      const avatar = el("span", "avatar avatar-lg", (data.agent_name || "?").slice(0, 1).toUpperCase());
      avatar.setAttribute("aria-hidden", "true");
      empty.append(avatar, el("h2", "", "Chat with " + data.agent_name), el("p", "muted", "Thumbs and corrections teach this agent your preferences."));
      listEl.append(empty);
      return;
    }
    const cutBefore = cutMarkerTurnId(branch.map((e) => e.turn));
    const lastAssistant = [...branch].reverse().find((e) => e.turn.role === "assistant");
    for (const entry of branch) {
      if (entry.turn.id === cutBefore) {
        const marker = el("div", "cut-marker");
        marker.setAttribute("role", "separator");
        marker.append(el("span", "", "History was cut here: earlier messages didn't fit in the model's context"));
        listEl.append(marker);
      }
      listEl.append(renderTurn(entry.turn, entry.siblings, lastAssistant && lastAssistant.turn.id === entry.turn.id));
    }
  }

  function cutMarkerTurnId(branch) {
    const replies = branch.filter((t) => t.role === "assistant" && t.context_start_index != null);
    if (!replies.length || !branch.length) return null;
    const start = replies[replies.length - 1].context_start_index;
    if (branch[0].index >= start) return null;
    const first = branch.find((t) => t.index >= start);
    return first ? first.id : null;
  }

  function renderTurn(turn, siblings, isLastReply) {
    const article = el("article", "msg msg-" + turn.role);
    article.dataset.turnId = turn.id;
    article.dataset.status = turn.status;
    const feedback = turn.feedback || {};
    if (feedback.thumb) article.dataset.thumb = feedback.thumb.kind;
    const body = el("div", "msg-body");
    article.append(body);

    const meta = el("div", "msg-meta");
    meta.append(el("span", "msg-author", turn.role === "user" ? "You" : data.agent_name));
    if (turn.role === "assistant") {
      const version = el("span", "badge badge-version", versionOf(turn));
      version.title = "Adapter version that produced this reply";
      meta.append(version);
      if (turn.status && turn.status !== "complete" && turn.status !== "streaming") {
        meta.append(el("span", "badge badge-status badge-" + turn.status, turn.status));
      }
    }
    body.append(meta);

    const content = el("div", "msg-content" + (turn.role === "assistant" ? " markdown" : ""));
    if (turn.role === "assistant") {
      if (turn.status === "streaming" && !turn.content) {
        const typing = el("div", "typing");
        typing.setAttribute("aria-label", "Writing");
        typing.append(el("span"), el("span"), el("span"));
        content.append(typing);
      } else {
        renderMarkdown(content, turn.content);
      }
    } else {
      content.textContent = turn.content;
    }
    body.append(content);

    if (turn.role !== "assistant") {
      const actions = el("div", "msg-actions");
      const copy = iconButton("copy", "Copy message", "copy");
      actions.append(copy);
      body.append(actions);
      return article;
    }

    if (turn.status === "failed") {
      const error = el("div", "msg-error");
      error.setAttribute("role", "alert");
      error.append(el("span", "", turn.error || "The reply failed."));
      const retry = el("button", "btn btn-sm", "Retry");
      retry.type = "button";
      retry.dataset.action = "retry";
      error.append(retry);
      body.append(error);
    }
    if (feedback.correction) {
      const box = el("div", "msg-correction");
      box.append(el("div", "msg-correction-head", "Your correction"), el("div", "msg-correction-text", feedback.correction.corrected_text));
      body.append(box);
    }
    if (feedback.thumb && (feedback.thumb.reason || feedback.thumb.comment)) {
      const note = el("div", "msg-feedback-note");
      note.textContent = (feedback.thumb.kind === "thumb_up" ? "Rated good: " : "Rated bad: ") + [feedback.thumb.reason, feedback.thumb.comment].filter(Boolean).join(" — ");
      body.append(note);
    }

    if (turn.status !== "streaming") {
      const actions = el("div", "msg-actions");
      actions.setAttribute("role", "toolbar");
      actions.setAttribute("aria-label", "Reply actions");
      if (siblings && siblings.length > 1) {
        const pos = siblings.findIndex((t) => t.id === turn.id);
        const nav = el("div", "sibling-nav");
        const prev = iconButton("prev-sibling", "Previous version of this reply", "prev");
        const next = iconButton("next-sibling", "Next version of this reply", "next");
        prev.disabled = pos <= 0;
        next.disabled = pos >= siblings.length - 1;
        const label = el("span", "", (pos + 1) + "/" + siblings.length);
        label.setAttribute("aria-live", "polite");
        nav.append(prev, label, next);
        actions.append(nav);
      }
      const rateable = turn.status === "complete" || turn.status === "stopped";
      actions.append(iconButton("copy", "Copy reply", "copy"));
      if (rateable) {
        const thumb = feedback.thumb ? feedback.thumb.kind : null;
        actions.append(
          iconButton("thumb_up", thumb === "thumb_up" ? "Remove good response rating" : "Good response", "up", thumb === "thumb_up"),
          iconButton("thumb_down", thumb === "thumb_down" ? "Remove bad response rating" : "Bad response", "down", thumb === "thumb_down"),
          iconButton("correct", "Correct this reply", "edit", !!feedback.correction),
        );
      }
      if (isLastReply) actions.append(iconButton("regenerate", "Regenerate reply", "regen"));
      body.append(actions);
    }
    if (state.openEditor && state.openEditor.turnId === turn.id) {
      body.append(state.openEditor.kind === "correct" ? correctionForm(turn) : feedbackForm(turn, state.openEditor.kind));
    }
    return article;
  }

  // Streaming: re-render only the growing reply, at most once per frame.
  const dirty = new Set();
  let frameQueued = false;
  function scheduleContent(turnId) {
    dirty.add(turnId);
    if (frameQueued) return;
    frameQueued = true;
    requestAnimationFrame(() => {
      frameQueued = false;
      const stick = nearBottom();
      for (const id of dirty) {
        const turn = state.turns.get(id);
        const node = listEl.querySelector('article[data-turn-id="' + id + '"] .msg-content');
        if (turn && node) renderMarkdown(node, turn.content);
      }
      dirty.clear();
      if (stick) scrollToBottom();
    });
  }

  function nearBottom() {
    return messagesEl.scrollHeight - messagesEl.scrollTop - messagesEl.clientHeight < 120;
  }
  function scrollToBottom() {
    messagesEl.scrollTop = messagesEl.scrollHeight;
  }

  // ---------------------------------------------------------------- feedback forms

  function feedbackForm(turn, kind) {
    const formEl = el("form", "feedback-form");
    formEl.dataset.turnId = turn.id;
    formEl.dataset.kind = kind;
    const fieldset = el("fieldset");
    fieldset.append(el("legend", "", kind === "thumb_up" ? "What was good? (optional)" : "What went wrong? (optional)"));
    const chips = el("div", "chips");
    (data.reasons[kind] || []).forEach((reason, i) => {
      const label = el("label", "chip");
      const radio = document.createElement("input");
      radio.type = "radio";
      radio.name = "reason";
      radio.value = reason;
      radio.id = "reason-" + turn.id + "-" + i;
      label.append(radio, el("span", "", reason));
      chips.append(label);
    });
    fieldset.append(chips);
    const commentLabel = el("label", "sr-only", "Comment");
    commentLabel.htmlFor = "comment-" + turn.id;
    const comment = document.createElement("textarea");
    comment.name = "comment";
    comment.id = "comment-" + turn.id;
    comment.rows = 2;
    comment.maxLength = data.max_correction_chars;
    comment.placeholder = "Add a comment (optional)";
    const row = el("div", "form-row-end");
    const cancel = el("button", "btn btn-ghost btn-sm", "Cancel");
    cancel.type = "button";
    cancel.dataset.action = "close-editor";
    const submit = el("button", "btn btn-primary btn-sm", "Submit");
    submit.type = "submit";
    row.append(cancel, submit);
    formEl.append(fieldset, commentLabel, comment, row);
    return formEl;
  }

  function correctionForm(turn) {
    const formEl = el("form", "correction-form");
    formEl.dataset.turnId = turn.id;
    formEl.dataset.kind = "correction";
    const label = el("label", "small", "Correct this reply: write what the agent should have said.");
    label.htmlFor = "correction-" + turn.id;
    const area = document.createElement("textarea");
    area.id = "correction-" + turn.id;
    area.name = "corrected_text";
    area.maxLength = data.max_correction_chars;
    const existing = turn.feedback && turn.feedback.correction;
    area.value = existing ? existing.corrected_text : turn.content;
    const row = el("div", "form-row-end");
    const cancel = el("button", "btn btn-ghost btn-sm", "Cancel");
    cancel.type = "button";
    cancel.dataset.action = "close-editor";
    const submit = el("button", "btn btn-primary btn-sm", "Save correction");
    submit.type = "submit";
    row.append(cancel, submit);
    formEl.append(label, area, row);
    return formEl;
  }

  function openEditor(turnId, kind) {
    state.openEditor = { turnId, kind };
    renderAll();
    const formEl = listEl.querySelector('article[data-turn-id="' + turnId + '"] form');
    if (formEl) {
      const focus = formEl.querySelector(kind === "correct" ? "textarea" : "input, textarea");
      if (focus) focus.focus();
      formEl.scrollIntoView({ block: "nearest" });
    }
  }

  function closeEditor() {
    const had = state.openEditor;
    state.openEditor = null;
    renderAll();
    if (had) focusAction(had.turnId, had.kind === "correct" ? "correct" : had.kind);
  }

  function focusAction(turnId, action) {
    const button = listEl.querySelector('article[data-turn-id="' + turnId + '"] [data-action="' + action + '"]');
    if (button) button.focus();
  }

  async function api(method, url, payload) {
    const response = await fetch(url, {
      method,
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken, Accept: "application/json" },
      body: payload === undefined ? undefined : JSON.stringify(payload),
    });
    let body = null;
    try { body = await response.json(); } catch (e) { /* empty body */ }
    if (!response.ok) {
      const message = (body && body.error && (body.error.message || body.error)) || "Request failed (" + response.status + ").";
      throw new Error(typeof message === "string" ? message : "Request failed.");
    }
    return body || {};
  }

  function feedbackUrl(turnId) {
    return data.feedback_url_template.replace("/0/", "/" + turnId + "/");
  }

  async function sendFeedback(turn, payload) {
    const result = await api("POST", feedbackUrl(turn.id), payload);
    const fb = result.feedback || payload;
    turn.feedback = turn.feedback || {};
    if (payload.kind === "correction") {
      turn.feedback.correction = { id: fb.id, corrected_text: fb.corrected_text || payload.corrected_text, status: fb.status };
    } else {
      turn.feedback.thumb = { id: fb.id, kind: fb.kind || payload.kind, reason: fb.reason || "", comment: fb.comment || "" };
    }
  }

  async function withdrawThumb(turn) {
    await api("DELETE", feedbackUrl(turn.id) + "/thumb");
    if (turn.feedback) delete turn.feedback.thumb;
  }

  listEl.addEventListener("submit", async (event) => {
    const formEl = event.target;
    if (!formEl.matches(".feedback-form, .correction-form")) return;
    event.preventDefault();
    const turn = state.turns.get(Number(formEl.dataset.turnId));
    if (!turn) return;
    const submit = formEl.querySelector('button[type="submit"]');
    submit.disabled = true;
    const kind = formEl.dataset.kind;
    try {
      if (kind === "correction") {
        const text = formEl.querySelector("textarea").value;
        if (!text.trim()) throw new Error("Write the corrected reply first.");
        await sendFeedback(turn, { kind: "correction", corrected_text: text });
        toast("Correction saved. Thanks!", "success");
      } else {
        const reason = formEl.querySelector('input[name="reason"]:checked');
        await sendFeedback(turn, {
          kind,
          reason: reason ? reason.value : "",
          comment: formEl.querySelector("textarea").value.trim(),
        });
        toast("Feedback saved.", "success");
      }
      state.openEditor = null;
      renderAll();
      focusAction(turn.id, kind === "correction" ? "correct" : kind);
    } catch (error) {
      submit.disabled = false;
      toast(error.message, "error");
    }
  });

  // ---------------------------------------------------------------- message actions

  listEl.addEventListener("click", async (event) => {
    const button = event.target.closest("button[data-action]");
    if (!button) return;
    const article = button.closest("article[data-turn-id]");
    const turn = article && state.turns.get(Number(article.dataset.turnId));
    if (!turn) return;
    const action = button.dataset.action;
    if (action === "copy") {
      window.clawCopy(turn.content).then(() => toast("Copied to clipboard."));
    } else if (action === "thumb_up" || action === "thumb_down") {
      const current = turn.feedback && turn.feedback.thumb;
      if (current && current.kind === action) {
        try {
          await withdrawThumb(turn);
          toast("Rating removed.");
          state.openEditor = null;
          renderAll();
          focusAction(turn.id, action);
        } catch (error) { toast(error.message, "error"); }
      } else if (state.openEditor && state.openEditor.turnId === turn.id && state.openEditor.kind === action) {
        closeEditor();
      } else {
        openEditor(turn.id, action);
      }
    } else if (action === "correct") {
      if (state.openEditor && state.openEditor.turnId === turn.id && state.openEditor.kind === "correct") closeEditor();
      else openEditor(turn.id, "correct");
    } else if (action === "close-editor") {
      closeEditor();
    } else if (action === "regenerate") {
      send({ type: "message.regenerate", turn_id: turn.id });
    } else if (action === "retry") {
      button.disabled = true;
      send({ type: "message.retry", turn_id: turn.id });
    } else if (action === "prev-sibling" || action === "next-sibling") {
      const kids = childrenOf(turn.parent_id);
      const pos = kids.findIndex((t) => t.id === turn.id) + (action === "prev-sibling" ? -1 : 1);
      if (kids[pos]) {
        state.chosen.set(keyOf(turn.parent_id), kids[pos].id);
        renderAll();
        focusAction(kids[pos].id, action);
      }
    }
  });

  // ---------------------------------------------------------------- socket

  function socketUrl() {
    return (location.protocol === "https:" ? "wss://" : "ws://") + location.host + data.ws_path;
  }

  function connect() {
    setConn("connecting", "Connecting…");
    const socket = new WebSocket(socketUrl());
    state.socket = socket;
    socket.addEventListener("open", () => {
      state.retryDelay = 500;
      setConn("open", "Connected");
      const queued = state.outbox.splice(0);
      for (const frame of queued) socket.send(JSON.stringify(frame));
    });
    socket.addEventListener("message", (event) => {
      let frame;
      try { frame = JSON.parse(event.data); } catch (e) { return; }
      handleFrame(frame);
    });
    socket.addEventListener("close", (event) => {
      if (state.socket !== socket) return;
      state.socket = null;
      if (event.code === 4401) {
        setConn("closed", "Signed out: reload to log in again");
        return;
      }
      setConn("closed", "Reconnecting…");
      // Replies streaming on this socket were stopped server-side; show them as saved after reconnect.
      if (state.streaming.size) {
        for (const id of state.streaming) {
          const turn = state.turns.get(id);
          if (turn) turn.status = "stopped";
        }
        state.streaming.clear();
        setStreaming(false);
        renderAll();
      }
      if (state.pendingSend) {
        state.pendingSend = null;
        sendBtn.disabled = false;
        toast("Connection lost. Your message is still in the box; send it again.", "warning");
      }
      setTimeout(connect, state.retryDelay);
      state.retryDelay = Math.min(state.retryDelay * 2, 10000);
    });
  }

  function setConn(kind, text) {
    connEl.dataset.state = kind;
    connEl.textContent = text;
  }

  let requestCounter = 0;
  function send(frame) {
    frame.request_id = frame.request_id || "r" + Date.now().toString(36) + "-" + (++requestCounter);
    if (state.socket && state.socket.readyState === WebSocket.OPEN) state.socket.send(JSON.stringify(frame));
    else state.outbox.push(frame);
    return frame.request_id;
  }

  function upsertTurn(payload) {
    const existing = state.turns.get(payload.id);
    const turn = Object.assign(existing || { feedback: {} }, payload);
    if (!turn.feedback) turn.feedback = {};
    state.turns.set(turn.id, turn);
    return turn;
  }

  function handleFrame(frame) {
    switch (frame.type) {
      case "conversation.created":
        onConversationCreated(frame.conversation);
        break;
      case "message.saved": {
        const turn = upsertTurn(frame.turn);
        if (state.pendingSend && (!frame.request_id || frame.request_id === state.pendingSend.requestId)) {
          // Only now is the text safe to clear: the server has stored it.
          input.value = "";
          autosize();
          clearDraft();
          state.pendingSend = null;
        }
        if (!state.title && turn.conversation_id === state.conversationId) setTitle(titleFrom(turn.content));
        showThrough(turn);
        renderAll();
        scrollToBottom();
        break;
      }
      case "reply.started": {
        if (frame.turn.conversation_id != null && frame.turn.conversation_id !== state.conversationId) break;
        const turn = upsertTurn(Object.assign({ status: "streaming" }, frame.turn));
        turn.content = frame.turn.content || "";
        state.streaming.add(turn.id);
        setStreaming(true);
        showThrough(turn);
        state.openEditor = null;
        renderAll();
        scrollToBottom();
        break;
      }
      case "reply.delta": {
        const turn = state.turns.get(frame.turn_id);
        if (!turn) break;
        turn.content = (turn.content || "") + (frame.text || "");
        scheduleContent(turn.id);
        break;
      }
      case "reply.done": {
        if (frame.turn.conversation_id != null && frame.turn.conversation_id !== state.conversationId) break;
        upsertTurn(frame.turn);
        state.streaming.delete(frame.turn.id);
        setStreaming(state.streaming.size > 0);
        const stick = nearBottom();
        renderAll();
        if (stick) scrollToBottom();
        if (frame.turn.status === "failed") sendBtn.disabled = false;
        break;
      }
      case "error":
        onError(frame);
        break;
      case "job.progress":
        onJobProgress(frame);
        break;
      case "version.activated":
        if (frame.agent_id == null || frame.agent_id === state.agentId) {
          toast(frame.version ? "Now using your adapter " + (frame.version.label || frame.version.name || frame.version) + "." : "Now using the base model.");
        }
        refreshPanel();
        break;
      default:
        break;
    }
  }

  function onConversationCreated(conversation) {
    if (!conversation || state.conversationId) return;
    const oldDraftKey = draftKey();
    state.conversationId = conversation.id;
    try {
      const draft = localStorage.getItem(oldDraftKey);
      localStorage.removeItem(oldDraftKey);
      if (draft) localStorage.setItem(draftKey(), draft);
    } catch (e) { /* private mode */ }
    const url = data.conversation_url_template.replace("/0/", "/" + conversation.id + "/");
    history.replaceState(null, "", url);
    setTitle(conversation.title || "");
    addToSidebar(conversation, url);
  }

  function addToSidebar(conversation, url) {
    const nav = document.querySelector(".conv-list");
    if (!nav) return;
    const emptyNote = nav.querySelector(".conv-empty");
    if (emptyNote) emptyNote.remove();
    let group = nav.querySelector('.conv-group[data-group="Today"]');
    if (!group) {
      group = el("section", "conv-group");
      group.dataset.group = "Today";
      group.append(el("h2", "conv-group-title", "Today"), el("ul"));
      group.querySelector("ul").setAttribute("role", "list");
      nav.prepend(group);
    }
    nav.querySelectorAll(".conv-item.active").forEach((item) => {
      item.classList.remove("active");
      const a = item.querySelector("a");
      if (a) a.removeAttribute("aria-current");
    });
    const item = el("li", "conv-item active");
    item.dataset.conversationId = conversation.id;
    const link = el("a", "", conversation.title || "New conversation");
    link.href = url;
    link.setAttribute("aria-current", "page");
    item.append(link);
    group.querySelector("ul").prepend(item);
  }

  function titleFrom(text) {
    const words = (text || "").split(/\s+/).join(" ").trim();
    return words.length <= 60 ? words : words.slice(0, 59) + "…";
  }

  function setTitle(title) {
    state.title = title;
    const shown = title || (state.conversationId ? "Untitled" : "New conversation");
    titleEl.textContent = shown;
    document.title = shown + " · " + data.agent_name + " · Claw";
    const link = document.querySelector('.conv-item[data-conversation-id="' + state.conversationId + '"] a');
    if (link && title) link.textContent = title;
  }

  function onError(frame) {
    const mine = state.pendingSend && (!frame.request_id || frame.request_id === state.pendingSend.requestId);
    if (mine) {
      state.pendingSend = null;  // the text stays in the box
      sendBtn.disabled = false;
    }
    if (!state.streaming.size) setStreaming(false);
    listEl.querySelectorAll('button[data-action="retry"]:disabled').forEach((b) => { b.disabled = false; });
    toast(frame.message || "Something went wrong.", "error");
  }

  function onJobProgress(frame) {
    const selector = 'progress[data-job-id="' + CSS.escape(String(frame.job_id)) + '"]';
    document.querySelectorAll(selector).forEach((bar) => {
      if (typeof frame.progress === "number") bar.value = frame.progress;
    });
    if (TERMINAL_JOB_STATES.has(String(frame.state))) refreshPanel();
  }

  function refreshPanel() {
    document.body.dispatchEvent(new CustomEvent("claw:refresh-panel", { bubbles: true }));
  }

  // ---------------------------------------------------------------- composer

  function setStreaming(on) {
    stopBtn.hidden = !on;
    sendBtn.hidden = on;
    if (!on) sendBtn.disabled = !!state.pendingSend;
  }

  function stopGeneration() {
    for (const id of state.streaming) send({ type: "generation.stop", turn_id: id });
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const content = input.value;
    if (!content.trim() || state.pendingSend || state.streaming.size) return;
    const requestId = send({
      type: "message.send",
      conversation_id: state.conversationId,
      agent_id: state.agentId,
      content,
    });
    state.pendingSend = { requestId, content };
    sendBtn.disabled = true;
  });

  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing && !event.altKey && !event.ctrlKey && !event.metaKey) {
      event.preventDefault();
      form.requestSubmit();
    }
  });

  stopBtn.addEventListener("click", stopGeneration);

  document.addEventListener("keydown", (event) => {
    if (event.key !== "Escape") return;
    if (state.streaming.size) {
      event.preventDefault();
      stopGeneration();
    } else if (state.openEditor) {
      closeEditor();
    }
  });

  function autosize() {
    input.style.height = "auto";
    input.style.height = Math.min(input.scrollHeight, window.innerHeight * 0.4) + "px";
  }

  // Drafts survive reloads and failed sends: one per conversation (or per agent before it exists).
  function draftKey() {
    return state.conversationId ? "claw:draft:c" + state.conversationId : "claw:draft:a" + state.agentId + ":new";
  }
  let draftTimer = null;
  function saveDraft() {
    clearTimeout(draftTimer);
    draftTimer = setTimeout(() => {
      try {
        if (input.value) localStorage.setItem(draftKey(), input.value);
        else localStorage.removeItem(draftKey());
      } catch (e) { /* private mode */ }
    }, 250);
  }
  function clearDraft() {
    clearTimeout(draftTimer);
    try { localStorage.removeItem(draftKey()); } catch (e) { /* private mode */ }
  }

  input.addEventListener("input", () => { autosize(); saveDraft(); });

  // ---------------------------------------------------------------- toasts

  function toast(message, kind) {
    const node = el("div", "toast toast-" + (kind || "info"), message);
    toastRegion.append(node);
    setTimeout(() => node.remove(), kind === "error" ? 8000 : 4000);
  }

  // htmx leaves the panel's placeholder on an error; say what happened instead.
  document.body.addEventListener("htmx:responseError", (event) => {
    const target = event.detail && event.detail.target;
    if (target && target.id === "panel-body") {
      target.replaceChildren(el("p", "muted small", "Personalization isn't available right now."));
    }
  });

  // ---------------------------------------------------------------- start

  try {
    const draft = localStorage.getItem(draftKey());
    if (draft && !input.value) input.value = draft;
  } catch (e) { /* private mode */ }
  setStreaming(false);
  renderAll();
  autosize();
  scrollToBottom();
  connect();
  input.focus();
})();
