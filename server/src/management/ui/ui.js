// CapyCTL's web page (/ui/): the deployments, the hosts, the live load and a timeline of the
// recent switches, read from the management API every second. Plain JavaScript, no framework,
// no build step; the server embeds this file in its binary.
//
// The admin token is kept in this tab's sessionStorage only and sent with every API request
// (Authorization: Bearer, and X-CapyCTL-Token for proxies that strip Authorization). A
// `#token=...` fragment fills it and is then removed from the address bar. A 401 asks again.
//
// Everything shown is built with DOM calls and textContent (never parsed from HTML text), and
// every look is a class of ui.css: the page's Content-Security-Policy allows no inline script
// or style.
'use strict';

(() => {
  // The API, relative to /ui/ so that the page also works under a proxy's path prefix.
  const API = '../management/v1';
  const TOKEN_KEY = 'capyctl.admin_token';
  const WINDOW_KEY = 'capyctl.window_s';
  const POLL_MS = 1000;
  // What the page keeps: at most this many switch records and an hour of load samples.
  const MAX_SWITCHES = 1000;
  const MAX_SAMPLES = 3600;
  const KEEP_MS = 3600 * 1000;
  const PHASES = ['admission_window', 'drain', 'park', 'stop', 'wake', 'start', 'wake_check',
    'release', 'adapter_load', 'adapter_unload'];
  const PHASE_NAMES = {
    admission_window: 'admission window', drain: 'drain', park: 'park (victim)',
    stop: 'stop (victim)', wake: 'wake', start: 'start', wake_check: 'wake check',
    release: 'release', adapter_load: 'adapter load', adapter_unload: 'adapter unload',
  };
  const SERIES = 8;
  const SVG_NS = 'http://www.w3.org/2000/svg';

  const $ = (id) => document.getElementById(id);

  // -------------------------------------------------------------------------------------------
  // State
  // -------------------------------------------------------------------------------------------

  const state = {
    // Bumped when the token changes: answers to older polls are dropped.
    generation: 0,
    timer: null,
    // seq -> switch record.
    switches: new Map(),
    // The highest seq read (the `next` of the last answer).
    next: 0,
    // null until known; false when the server has no /switches route (404).
    switchesRoute: null,
    // Load samples: {t: server ms, waiting: Map(name -> n), inFlight: Map(name -> n)}.
    samples: [],
    // Server clock minus this browser's clock (ms), from the load read's observed_at_ms.
    offset: 0,
    deployments: [],
    hosts: [],
    load: null,
    // instance id -> deployment name, from the deployments and the records.
    instanceNames: new Map(),
    // instance id -> host id, from the deployments and the records.
    instanceHosts: new Map(),
    // deployment name -> series index (the waiting line's colour), in order of appearance.
    series: new Map(),
    // The last drawn inputs of the tables (to redraw only on change).
    drawn: { deployments: '', hosts: '', switches: '', tenants: '' },
    // SVG elements by key, kept across redraws so that a hovered bar keeps its title.
    pool: new Map(),
  };

  const serverNow = () => Date.now() + state.offset;

  // -------------------------------------------------------------------------------------------
  // The token
  // -------------------------------------------------------------------------------------------

  class NeedToken extends Error {}

  function token() {
    return sessionStorage.getItem(TOKEN_KEY);
  }

  // `#token=...` (and other keys, kept) in the fragment: store it, then drop it from the
  // address bar and from the history entry.
  function takeFragmentToken() {
    const fragment = location.hash.replace(/^#/, '');
    if (!fragment) return;
    const params = new URLSearchParams(fragment);
    if (!params.has('token')) return;
    const t = (params.get('token') || '').trim();
    params.delete('token');
    const rest = params.toString();
    history.replaceState(history.state, '', location.pathname + location.search +
      (rest ? '#' + rest : ''));
    if (t) sessionStorage.setItem(TOKEN_KEY, t);
  }

  function askForToken(message) {
    stop();
    sessionStorage.removeItem(TOKEN_KEY);
    state.generation += 1;
    $('dashboard').hidden = true;
    $('forget').hidden = true;
    $('login').hidden = false;
    const m = $('login-message');
    m.textContent = message || '';
    m.hidden = !message;
    setStatus('login', 'waiting for the admin token');
    $('token').value = '';
    $('token').focus();
  }

  function open() {
    $('login').hidden = true;
    $('dashboard').hidden = false;
    $('forget').hidden = false;
    state.generation += 1;
    setStatus('loading', 'loading…');
    stop();
    poll(state.generation);
  }

  function stop() {
    if (state.timer !== null) clearTimeout(state.timer);
    state.timer = null;
  }

  // -------------------------------------------------------------------------------------------
  // The API
  // -------------------------------------------------------------------------------------------

  // GET `path` of the management API as JSON; null on 404 when `allow404`.
  async function api(path, allow404) {
    const t = token();
    if (!t) throw new NeedToken('');
    let response;
    try {
      response = await fetch(API + path, {
        headers: { 'Authorization': 'Bearer ' + t, 'X-CapyCTL-Token': t },
        cache: 'no-store',
        credentials: 'omit',
      });
    } catch (e) {
      // A token a header cannot carry fails here, before anything is sent.
      if (e instanceof TypeError && /header|ByteString/i.test(String(e.message))) {
        throw new NeedToken(
          'That token cannot be sent (it holds characters a header cannot carry).');
      }
      throw new Error('cannot reach the server (' + e.message + ')');
    }
    if (response.status === 401) {
      throw new NeedToken(
        'The server refused the token (401 unauthorized). Enter the admin token.');
    }
    if (response.status === 404 && allow404) return null;
    let body = null;
    try {
      body = await response.json();
    } catch (e) {
      throw new Error(`GET ${path}: ${response.status}, not JSON`);
    }
    if (!response.ok) {
      const why = body && body.message ? body.message : String(response.status);
      throw new Error(`GET ${path}: ${why}`);
    }
    return body;
  }

  // Where to read switches from: before the oldest record still in progress (so that its end
  // is read too), else after the last one read.
  function switchesAfter() {
    let after = state.next;
    for (const r of state.switches.values()) {
      if (r.outcome === 'in_progress' || r.ended_ms === null) after = Math.min(after, r.seq - 1);
    }
    return Math.max(0, after);
  }

  async function poll(generation) {
    const sent = Date.now();
    try {
      const [deployments, hosts, load, switches, tenants] = await Promise.all([
        api('/deployments'),
        api('/hosts'),
        api('/metrics/load'),
        api('/switches?after=' + switchesAfter(), true),
        api('/tenants', true),
      ]);
      if (generation !== state.generation) return;
      const received = Date.now();
      state.deployments = deployments.deployments || [];
      state.hosts = hosts.hosts || [];
      state.load = load;
      state.tenants = (tenants && tenants.tenants) || [];
      if (typeof load.observed_at_ms === 'number') {
        state.offset = load.observed_at_ms - (sent + received) / 2;
      }
      takeSample(load);
      takeSwitches(switches);
      render();
      setStatus('ok', 'updated ' + clock(serverNow()) + ' · every ' + POLL_MS / 1000 + ' s');
    } catch (e) {
      if (generation !== state.generation) return;
      if (e instanceof NeedToken) {
        askForToken(e.message);
        return;
      }
      setStatus('error', String(e.message || e) + ' · retrying');
    }
    if (generation === state.generation) {
      state.timer = setTimeout(() => poll(generation), POLL_MS);
    }
  }

  function takeSample(load) {
    const waiting = new Map();
    const inFlight = new Map();
    for (const d of load.deployments || []) {
      waiting.set(d.name, d.router.waiting);
      inFlight.set(d.name, d.router.in_flight);
    }
    const t = typeof load.observed_at_ms === 'number' ? load.observed_at_ms : serverNow();
    state.samples.push({ t, waiting, inFlight });
    const oldest = t - KEEP_MS;
    while (state.samples.length > MAX_SAMPLES ||
      (state.samples.length && state.samples[0].t < oldest)) {
      state.samples.shift();
    }
  }

  function takeSwitches(answer) {
    if (answer === null) {
      state.switchesRoute = false;
      return;
    }
    state.switchesRoute = true;
    for (const r of answer.switches || []) state.switches.set(r.seq, r);
    if (typeof answer.next === 'number') state.next = Math.max(state.next, answer.next);
    if (state.switches.size > MAX_SWITCHES) {
      const seqs = [...state.switches.keys()].sort((a, b) => a - b);
      for (const s of seqs.slice(0, seqs.length - MAX_SWITCHES)) state.switches.delete(s);
    }
  }

  // -------------------------------------------------------------------------------------------
  // Drawing helpers
  // -------------------------------------------------------------------------------------------

  function setStatus(kind, text) {
    const s = $('status');
    s.dataset.status = kind;
    s.textContent = text;
  }

  // An HTML element: el('td', {class: 'num', 'data-x': 1}, 'text', child, ...).
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== undefined && v !== null) e.setAttribute(k, String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      e.append(c instanceof Node ? c : String(c));
    }
    return e;
  }

  function svg(tag, attrs) {
    const e = document.createElementNS(SVG_NS, tag);
    setAttrs(e, attrs);
    return e;
  }

  function setAttrs(e, attrs) {
    for (const [k, v] of Object.entries(attrs || {})) {
      const value = String(v);
      if (e.getAttribute(k) !== value) e.setAttribute(k, value);
    }
  }

  // A <title> child (a hover tooltip) of an SVG element, set only when it changed.
  function setTitle(e, text) {
    let t = e.querySelector('title');
    if (!t) {
      t = svg('title', {});
      e.append(t);
    }
    if (t.textContent !== text) t.textContent = text;
  }

  function pad(n) {
    return String(n).padStart(2, '0');
  }

  function clock(ms) {
    const d = new Date(ms);
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }

  function seconds(ms) {
    if (ms < 1000) return `${Math.round(ms)} ms`;
    if (ms < 60000) return `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
    return `${Math.floor(ms / 60000)} min ${Math.round((ms % 60000) / 1000)} s`;
  }

  function bytes(n) {
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    let v = n;
    while (v >= 1024 && i < units.length - 1) {
      v /= 1024;
      i += 1;
    }
    return `${v >= 10 || i === 0 ? Math.round(v) : v.toFixed(1)} ${units[i]}`;
  }

  function seriesOf(name) {
    if (!state.series.has(name)) state.series.set(name, state.series.size % SERIES);
    return state.series.get(name);
  }

  function stateBadge(s) {
    return el('span', { class: 'state state-' + s, 'data-state': s }, s.replace(/_/g, ' '));
  }

  // -------------------------------------------------------------------------------------------
  // Deployments, load, hosts
  // -------------------------------------------------------------------------------------------

  function render() {
    for (const d of state.deployments) {
      seriesOf(d.name);
      for (const i of d.instances || []) {
        state.instanceNames.set(i.instance_id, d.name);
        state.instanceHosts.set(i.instance_id, i.host_id);
      }
    }
    renderDeployments();
    renderHosts();
    renderTenants();
    renderSwitchList();
    renderTimeline();
  }

  function renderDeployments() {
    const loads = new Map();
    for (const l of (state.load && state.load.deployments) || []) loads.set(l.deployment_id, l);
    const key = JSON.stringify([state.deployments.map((d) => [d.id, d.name, d.state, d.ready,
      d.hosts, d.engine, d.model, d.operator_stopped, d.instances]),
      [...loads.values()].map((l) => [l.deployment_id, l.router])]);
    if (key === state.drawn.deployments) return;
    state.drawn.deployments = key;
    const rows = state.deployments.map((d) => {
      const load = loads.get(d.id);
      const router = load ? load.router : null;
      const instances = (d.instances || []).map((i) => el('span', {
        class: 'instance', 'data-instance': i.instance_id, 'data-state': i.state,
        title: `${i.instance_id} on ${i.host_id}, generation ${i.generation}` +
          (i.pid ? `, pid ${i.pid}` : '') + (i.port ? `, port ${i.port}` : ''),
      }, `#${i.index} `, stateBadge(i.state),
      i.parked_tier ? ` ${i.parked_tier}` : '', ` ${i.host_id}`,
      i.last_error ? el('span', { class: 'err' }, i.last_error) : null));
      return el('tr', { 'data-deployment': d.name, 'data-deployment-id': d.id,
        'data-state': d.state },
      el('td', { title: d.id }, el('strong', {}, d.name)),
      el('td', {}, stateBadge(d.state), d.operator_stopped ? ' (stopped by an operator)' : ''),
      el('td', { class: 'num' }, d.ready),
      el('td', {}, `${d.engine} · `, el('span', { class: 'mono' }, d.model)),
      el('td', {}, (d.hosts || []).join(', ') || '-'),
      el('td', { class: 'num', 'data-load': 'in_flight' },
        router ? `${router.in_flight} / ${router.in_flight_limit}` : '-'),
      el('td', { class: 'num', 'data-load': 'waiting' },
        router ? `${router.waiting} / ${router.waiting_limit}` : '-'),
      el('td', {}, ...instances));
    });
    $('deployments').tBodies[0].replaceChildren(...rows);
    $('deployments-note').textContent = rows.length ? ''
      : 'No deployments: deploy one with `capyctl deploy model --file model.yaml`.';
  }

  function renderHosts() {
    const key = JSON.stringify(state.hosts);
    if (key === state.drawn.hosts) return;
    state.drawn.hosts = key;
    const hosts = state.hosts.map((h) => el('div', { class: 'host', 'data-host': h.id },
      el('h3', {}, h.id, h.cordoned ? el('span', { class: 'cordoned' }, ' · cordoned') : null),
      ...(h.gpus || []).map((g) => el('div', { class: 'gpu', 'data-gpu': gpuName(g) },
        el('span', { title: g.uuid || '' }, `GPU ${g.index}${g.unified ? ' (unified)' : ''}`),
        el('meter', { min: 0, max: g.memory, value: g.used, low: g.memory * 0.75,
          high: g.memory * 0.95, optimum: 0 }),
        el('span', { class: 'num' }, `${bytes(g.used)} / ${bytes(g.memory)}`))),
      el('div', { class: 'gpu' }, el('span', {}, 'host RAM (parked)'),
        el('meter', { min: 0, max: h.host_memory, value: h.host_memory_used }),
        el('span', {}, `${bytes(h.host_memory_used)} / ${bytes(h.host_memory)}`))));
    $('hosts').replaceChildren(...hosts);
  }

  // The inference listener's tenants (DESIGN 4.10): shown only when some are configured.
  function renderTenants() {
    const tenants = state.tenants || [];
    const key = JSON.stringify(tenants);
    if (key === state.drawn.tenants) return;
    state.drawn.tenants = key;
    $('tenants-section').hidden = tenants.length === 0;
    const rows = tenants.map((t) => {
      const rate = [];
      if (t.requests_per_minute) {
        rate.push(`${t.requests_per_minute} req/min (${t.remaining_requests} left)`);
      }
      if (t.tokens_per_minute) {
        rate.push(`${t.tokens_per_minute} tok/min (${t.remaining_tokens} left)`);
      }
      const answers = Object.entries(t.answers || {}).map(([s, n]) => `${s}: ${n}`);
      return el('tr', { 'data-tenant': t.name },
        el('td', {}, el('strong', {}, t.name)),
        el('td', { class: 'mono' }, t.models ? t.models.join(', ') : '*'),
        el('td', {}, rate.join(', ') || '-'),
        el('td', { class: 'num' }, t.keys),
        el('td', {}, answers.join(' · ') || '-'),
        el('td', { class: 'num' }, t.tokens),
        el('td', { class: 'num', 'data-load': 'waiting' }, t.waiting));
    });
    $('tenants').tBodies[0].replaceChildren(...rows);
  }

  function gpuName(g) {
    return g.uuid || String(g.index);
  }

  // -------------------------------------------------------------------------------------------
  // Switches
  // -------------------------------------------------------------------------------------------

  function windowMs() {
    return Number($('window').value) * 1000;
  }

  // The records that overlap the window, oldest first.
  function switchesInWindow(from) {
    return [...state.switches.values()]
      .filter((r) => (r.ended_ms === null ? serverNow() : r.ended_ms) >= from)
      .sort((a, b) => a.seq - b.seq);
  }

  function nameOf(instance, fallback) {
    return state.instanceNames.get(instance) || fallback || instance;
  }

  function victimsText(r) {
    return (r.victims || []).map((v) => `${v.deployment} ${v.action} → ${v.result}` +
      (v.error ? ` (${v.error.code})` : '')).join(', ');
  }

  // A switch's hover text: its id, cause, wave, outcome and error (and the phase, if any).
  function describe(r, phase) {
    const lines = [`switch ${r.switch_id} (#${r.seq})`,
      `${r.deployment}: cause ${r.cause}, wave ${r.wave}`];
    if (phase) {
      const end = phase.ended_ms === null ? serverNow() : phase.ended_ms;
      const whose = nameOf(phase.instance);
      lines.push(`${PHASE_NAMES[phase.phase] || phase.phase} of ${whose}: ` +
        seconds(end - phase.began_ms) + (phase.ended_ms === null ? ' so far' : ''));
    }
    if (r.victims && r.victims.length) lines.push('victims: ' + victimsText(r));
    lines.push('outcome: ' + r.outcome.replace('_', ' '));
    if (r.error) lines.push(`error: ${r.error.code}: ${r.error.message}`);
    return lines.join('\n');
  }

  function renderSwitchList() {
    const recent = [...state.switches.values()].sort((a, b) => b.seq - a.seq).slice(0, 6);
    const now = serverNow();
    const key = JSON.stringify(recent.map((r) => [r.seq, r.outcome, r.ended_ms,
      r.ended_ms === null ? Math.floor(now / 1000) : 0]));
    if (key !== state.drawn.switches) {
      state.drawn.switches = key;
      const rows = recent.map((r) => el('tr', { 'data-switch-id': r.switch_id,
        'data-outcome': r.outcome, title: describe(r) },
      el('td', {}, clock(r.began_ms)),
      el('td', { class: 'mono' }, r.switch_id),
      el('td', {}, r.deployment),
      el('td', {}, r.cause),
      el('td', { class: 'num' }, r.wave),
      el('td', {}, victimsText(r) || '-'),
      el('td', { class: 'num' }, seconds((r.ended_ms === null ? now : r.ended_ms) - r.began_ms)),
      el('td', { class: 'outcome-' + r.outcome },
        r.outcome.replace('_', ' ') + (r.error ? `: ${r.error.code}` : ''))));
      $('switches').tBodies[0].replaceChildren(...rows);
      $('switches').hidden = rows.length === 0;
    }
    const note = $('switches-note');
    if (state.switchesRoute === false) {
      note.textContent = 'no switch records (this server does not serve /management/v1/switches)';
    } else if (state.switches.size === 0) {
      note.textContent = 'no switch records yet';
    } else {
      note.textContent = `${state.switches.size} switch records read`;
    }
  }

  // The timeline's rows: one per GPU (host and GPUs of the target) or, when a record names no
  // GPU, one per instance. Within a row, one lane per instance seen on it.
  function layoutRows(records) {
    // instance -> row key: the GPUs it had the last time it was a switch's target.
    const rowOf = new Map();
    const rows = new Map();
    const rowFor = (instance) => rowOf.get(instance) || 'instance:' + instance;
    const gpuRow = (r) => (r.gpus && r.gpus.length ? `gpu:${r.host_id}:${r.gpus.join('+')}` : null);
    for (const r of [...state.switches.values()].sort((a, b) => a.seq - b.seq)) {
      if (gpuRow(r)) rowOf.set(r.instance, gpuRow(r));
      state.instanceNames.set(r.instance, r.deployment);
      if (r.host_id) state.instanceHosts.set(r.instance, r.host_id);
      for (const v of r.victims || []) state.instanceNames.set(v.instance, v.deployment);
    }
    // A victim never seen as a target gave room on its switch's GPU: it is drawn there.
    for (const r of records) {
      for (const v of r.victims || []) {
        if (!rowOf.has(v.instance) && gpuRow(r)) rowOf.set(v.instance, gpuRow(r));
      }
    }
    const lane = (instance) => {
      const key = rowFor(instance);
      if (!rows.has(key)) {
        rows.set(key, { key, label: rowLabel(key, instance), lanes: [] });
      }
      const row = rows.get(key);
      if (!row.lanes.includes(instance)) row.lanes.push(instance);
      return row;
    };
    for (const r of records) {
      lane(r.instance);
      for (const v of r.victims || []) lane(v.instance);
      for (const p of r.phases || []) lane(p.instance);
    }
    return { rows: [...rows.values()], rowFor };
  }

  function rowLabel(key, instance) {
    if (key.startsWith('gpu:')) {
      const [, hostId, gpus] = key.match(/^gpu:([^:]*):(.*)$/) || [null, '', key];
      const names = gpus.split('+').map((uuid) => {
        const h = state.hosts.find((x) => x.id === hostId);
        const g = h && (h.gpus || []).find((x) => x.uuid === uuid || String(x.index) === uuid);
        return g ? `GPU ${g.index}` : uuid;
      });
      return `${hostId} · ${names.join(' + ')}`;
    }
    const host = state.instanceHosts.get(instance);
    const index = instance.split('-').pop();
    return `${nameOf(instance)} · instance ${index}` + (host ? ` · ${host}` : '');
  }

  function tickStep(spanMs, width) {
    const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800].map((s) => s * 1000);
    const want = Math.max(2, Math.floor(width / 110));
    return steps.find((s) => spanMs / s <= want) || steps[steps.length - 1];
  }

  function renderTimeline() {
    const host = $('timeline');
    const width = Math.max(560, host.clientWidth || 900);
    const now = serverNow();
    const span = windowMs();
    const from = now - span;
    const records = switchesInWindow(from);
    const { rows, rowFor } = layoutRows(records);

    const LEFT = 200;
    const RIGHT = 14;
    const LANE = 18;
    const ROW_PAD = 6;
    const WAIT_H = 64;
    const AXIS_H = 22;
    const plotW = width - LEFT - RIGHT;
    const x = (t) => LEFT + Math.min(1, Math.max(0, (t - from) / span)) * plotW;

    // Row geometry.
    let y = 4;
    const laneY = new Map();
    for (const row of rows) {
      row.y = y;
      row.h = Math.max(1, row.lanes.length) * LANE + ROW_PAD * 2;
      row.lanes.forEach((instance, i) => laneY.set(row.key + '|' + instance,
        y + ROW_PAD + i * LANE));
      y += row.h;
    }
    if (rows.length === 0) y += 30;
    const waitTop = y + 6;
    const axisTop = waitTop + WAIT_H;
    const height = axisTop + AXIS_H;

    let root = host.querySelector('svg');
    if (!root) {
      root = svg('svg', { role: 'img', 'aria-label': 'timeline of the recent switches' });
      for (const layer of ['grid', 'rows', 'bars', 'wait', 'axis']) {
        root.append(svg('g', { class: 'layer-' + layer }));
      }
      host.append(root);
    }
    setAttrs(root, { viewBox: `0 0 ${width} ${height}`, width, height,
      'data-window-s': span / 1000, 'data-rows': rows.length });
    const layer = (name) => root.querySelector('.layer-' + name);

    const used = new Set();
    // An element of `layer` by key: reused when it exists (a hovered bar keeps its title).
    const put = (layerName, key, tag, attrs) => {
      const k = layerName + '|' + key;
      used.add(k);
      let e = state.pool.get(k);
      if (!e) {
        e = svg(tag, {});
        state.pool.set(k, e);
        layer(layerName).append(e);
      }
      setAttrs(e, attrs);
      return e;
    };
    const text = (layerName, key, attrs, content) => {
      const e = put(layerName, key, 'text', attrs);
      if (e.textContent !== content) e.textContent = content;
      return e;
    };

    // Time axis and grid.
    const step = tickStep(span, plotW);
    for (let t = Math.ceil(from / step) * step; t <= now; t += step) {
      put('grid', 'tick' + t, 'line', { class: 'grid', x1: x(t), x2: x(t), y1: 0, y2: axisTop });
      text('axis', 'tick' + t, { x: x(t), y: axisTop + 15, 'text-anchor': 'middle',
        class: 'axis' }, clock(t));
    }
    put('axis', 'now', 'line', { class: 'now', x1: x(now), x2: x(now), y1: 0, y2: axisTop });
    put('axis', 'baseline', 'line', { class: 'row-sep', x1: LEFT, x2: LEFT + plotW,
      y1: axisTop, y2: axisTop });

    // Rows and lanes.
    for (const row of rows) {
      put('rows', 'sep' + row.key, 'line', { class: 'row-sep', x1: 0, x2: LEFT + plotW,
        y1: row.y + row.h, y2: row.y + row.h });
      text('rows', 'label' + row.key, { x: 6, y: row.y + ROW_PAD + 11, class: 'label',
        'data-row': row.key }, row.label);
      if (row.key.startsWith('gpu:')) {
        row.lanes.forEach((instance, i) => text('rows', `lane${row.key}|${instance}`, {
          x: LEFT - 6, y: row.y + ROW_PAD + i * LANE + 11, 'text-anchor': 'end',
          class: 'lane-label',
        }, nameOf(instance)));
      }
    }
    if (rows.length === 0) {
      text('rows', 'empty', { x: LEFT + 8, y: 24, class: 'empty' },
        state.switchesRoute === false ? 'no switch records'
          : `no switches in the last ${$('window').selectedOptions[0].textContent}`);
    }

    // Each switch: an outline over its target's lane, and its phases as bars.
    for (const r of records) {
      const end = r.ended_ms === null ? now : r.ended_ms;
      const ty = laneY.get(rowFor(r.instance) + '|' + r.instance);
      const outline = put('bars', 'switch' + r.seq, 'rect', {
        class: 'switch outcome-' + r.outcome, x: x(r.began_ms) - 1, y: ty - 2,
        width: Math.max(3, x(end) - x(r.began_ms) + 2), height: LANE + 1, rx: 2,
        'data-switch-id': r.switch_id, 'data-outcome': r.outcome, 'data-cause': r.cause,
        'data-deployment': r.deployment,
      });
      setTitle(outline, describe(r));
      (r.phases || []).forEach((p, i) => {
        const pend = p.ended_ms === null ? now : p.ended_ms;
        const py = laneY.get(rowFor(p.instance) + '|' + p.instance);
        const bar = put('bars', `phase${r.seq}|${i}`, 'rect', {
          class: `phase ph-${p.phase}` + (p.ended_ms === null ? ' in-progress' : ''),
          x: x(p.began_ms), y: py, width: Math.max(2, x(pend) - x(p.began_ms)),
          height: LANE - 3, 'data-switch-id': r.switch_id, 'data-phase': p.phase,
          'data-instance': p.instance, 'data-deployment': nameOf(p.instance),
          'data-victim': p.instance !== r.instance ? 'true' : 'false',
        });
        setTitle(bar, describe(r, p));
      });
    }

    // Waiting requests over time: one line per deployment that had any in the window.
    put('wait', 'area', 'rect', { class: 'waiting-area', x: LEFT, y: waitTop, width: plotW,
      height: WAIT_H - 4 });
    text('wait', 'label', { x: 6, y: waitTop + 14, class: 'label' }, 'waiting requests');
    const samples = state.samples.filter((s) => s.t >= from - POLL_MS);
    const names = new Set();
    let max = 1;
    for (const s of samples) {
      for (const [name, n] of s.waiting) {
        if (n > 0) names.add(name);
        max = Math.max(max, n);
      }
    }
    text('wait', 'max', { x: LEFT - 6, y: waitTop + 10, 'text-anchor': 'end',
      class: 'lane-label' }, String(max));
    text('wait', 'zero', { x: LEFT - 6, y: waitTop + WAIT_H - 6, 'text-anchor': 'end',
      class: 'lane-label' }, '0');
    const yOf = (n) => waitTop + WAIT_H - 5 - (n / max) * (WAIT_H - 12);
    for (const name of names) {
      const points = samples.map((s) => `${x(s.t).toFixed(1)},${yOf(s.waiting.get(name) || 0)
        .toFixed(1)}`).join(' ');
      const line = put('wait', 'line' + name, 'polyline', {
        class: `waiting series-${seriesOf(name)}`, points, 'data-series': 'waiting',
        'data-deployment': name,
      });
      const last = samples.length ? samples[samples.length - 1].waiting.get(name) || 0 : 0;
      setTitle(line, `${name}: ${last} waiting now, at most ${Math.max(...samples.map(
        (s) => s.waiting.get(name) || 0))} in the window`);
    }
    if (names.size === 0) {
      text('wait', 'none', { x: LEFT + 8, y: waitTop + WAIT_H / 2 + 4, class: 'empty' },
        'no request waited in the window');
    }

    // Drop what is no longer drawn.
    for (const [k, e] of state.pool) {
      if (!used.has(k)) {
        e.remove();
        state.pool.delete(k);
      }
    }
    renderLegend(names);
  }

  function renderLegend(waitingNames) {
    const key = JSON.stringify([...waitingNames]);
    const legend = $('legend');
    if (legend.dataset.key === key) return;
    legend.dataset.key = key;
    const items = PHASES.map((p) => el('span', { 'data-legend': p },
      el('i', { class: 'swatch ph-' + p }), PHASE_NAMES[p]));
    for (const name of waitingNames) {
      items.push(el('span', { 'data-legend': 'waiting', 'data-deployment': name },
        el('i', { class: `swatch line series-${seriesOf(name)}` }), `waiting: ${name}`));
    }
    legend.replaceChildren(...items);
  }

  // -------------------------------------------------------------------------------------------
  // Start
  // -------------------------------------------------------------------------------------------

  function start() {
    const saved = sessionStorage.getItem(WINDOW_KEY);
    if (saved && [...$('window').options].some((o) => o.value === saved)) {
      $('window').value = saved;
    }
    $('window').addEventListener('change', () => {
      sessionStorage.setItem(WINDOW_KEY, $('window').value);
      if (state.load) renderTimeline();
    });
    $('token-form').addEventListener('submit', (event) => {
      event.preventDefault();
      const t = $('token').value.trim();
      if (!/^[\x21-\x7e]+$/.test(t)) {
        askForToken('A token is one word of printable ASCII (no spaces).');
        return;
      }
      sessionStorage.setItem(TOKEN_KEY, t);
      $('token').value = '';
      open();
    });
    $('forget').addEventListener('click', () => askForToken(''));
    window.addEventListener('resize', () => {
      if (state.load) renderTimeline();
    });
    window.addEventListener('hashchange', () => {
      const before = token();
      takeFragmentToken();
      if (token() && token() !== before) open();
    });
    takeFragmentToken();
    if (token()) open();
    else askForToken('');
  }

  start();
})();
