//! OpenAI's request and response shapes: parameters checked one by one (a bad one is named in
//! a 400), answers whole or streamed as server-sent events.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use moeswarm_engine::speculative::{Speculation, SpeculationConfig};
use moeswarm_engine::text::SamplingConfig;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::batcher::{Event, Finish, Refusal, Request};
use super::{prepare, ApiState, MAX_BODY_BYTES};

/// Tokens generated when a request does not say.
const DEFAULT_MAX_TOKENS: usize = 256;
/// Most stop texts a request may give (OpenAI's limit).
const MAX_STOPS: usize = 4;
/// Longest stop text, in bytes (each is looked for after every token of the sequence).
const MAX_STOP_BYTES: usize = 512;

/// An error as OpenAI's API writes it.
pub(super) struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    /// The HTTP status it answers with.
    pub(super) fn status(&self) -> StatusCode {
        self.status
    }

    /// 503 with `Retry-After`: too much is waiting.
    pub(super) fn busy(message: String) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message,
            kind: "server_error",
            param: None,
            code: Some("queue_full"),
        }
    }

    /// 500: the server failed.
    pub(super) fn server(message: String) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message,
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// 413: the prompt (named by `param`) does not fit the context.
    pub(super) fn too_long(message: String, param: &'static str) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message,
            kind: "invalid_request_error",
            param: Some(param),
            code: Some("context_length_exceeded"),
        }
    }

    pub(super) fn bad(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param),
            code: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }});
        let mut r = (self.status, json_body(&body)).into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/json"),
        );
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        r
    }
}

fn json_body(v: &Value) -> String {
    serde_json::to_string(v).expect("JSON values always serialize")
}

pub(super) fn json_response(v: &Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], json_body(v)).into_response()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `GET /v1/models`.
pub(super) async fn models(State(st): State<ApiState>) -> Response {
    json_response(&json!({
        "object": "list",
        "data": [{"id": st.model, "object": "model", "created": 0, "owned_by": "moeswarm"}],
    }))
}

/// What both endpoints take besides the prompt.
struct Params {
    max_tokens: usize,
    sampling: SamplingConfig,
    speculation: SpeculationConfig,
    stop: Vec<String>,
    stream: bool,
}

pub(super) fn parse_body(body: &Bytes) -> Result<serde_json::Map<String, Value>, ApiError> {
    if body.len() > MAX_BODY_BYTES {
        return Err(ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the body is over {MAX_BODY_BYTES} bytes"),
            kind: "invalid_request_error",
            param: None,
            code: None,
        });
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad("body", "the body is not a JSON object")),
        Err(e) => Err(ApiError::bad("body", format!("the body is not JSON: {e}"))),
    }
}

fn number(v: &serde_json::Map<String, Value>, key: &'static str) -> Result<Option<f64>, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_f64()
            .map(Some)
            .ok_or_else(|| ApiError::bad(key, format!("{key} must be a number"))),
    }
}

fn params(v: &serde_json::Map<String, Value>, st: &ApiState) -> Result<Params, ApiError> {
    match v.get("model").and_then(Value::as_str) {
        None => return Err(ApiError::bad("model", "model is required (a string)")),
        Some(m) if m != st.model => {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "the model {m:?} does not exist; this server has {:?}",
                    st.model
                ),
                kind: "invalid_request_error",
                param: Some("model"),
                code: Some("model_not_found"),
            })
        }
        Some(_) => {}
    }
    let max_tokens = match number(v, "max_tokens")?.or(number(v, "max_completion_tokens")?) {
        None => DEFAULT_MAX_TOKENS,
        Some(n) if n >= 1.0 && n.fract() == 0.0 && n <= 1e9 => n as usize,
        Some(n) => {
            return Err(ApiError::bad(
                "max_tokens",
                format!("max_tokens {n} is not a positive integer"),
            ))
        }
    };
    let temperature = number(v, "temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(
            "temperature",
            format!("temperature {temperature} is outside 0..=2"),
        ));
    }
    let top_p = number(v, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(
            "top_p",
            format!("top_p {top_p} is outside (0, 1]"),
        ));
    }
    let seed = match v.get("seed") {
        None | Some(Value::Null) => 0,
        Some(s) => s
            .as_u64()
            .or_else(|| s.as_i64().map(|i| i as u64))
            .ok_or_else(|| ApiError::bad("seed", "seed must be an integer"))?,
    };
    match number(v, "n")? {
        None => {}
        Some(1.0) => {}
        Some(n) => return Err(ApiError::bad("n", format!("n = {n}: only n = 1 is served"))),
    }
    let stop = match v.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= MAX_STOPS => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::bad("stop", "stop must be strings"))?,
        Some(_) => {
            return Err(ApiError::bad(
                "stop",
                format!("stop must be a string or at most {MAX_STOPS} strings"),
            ))
        }
    };
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad(
            "stop",
            format!(
                "a stop text of {} bytes: at most {MAX_STOP_BYTES} each",
                long.len()
            ),
        ));
    }
    let mode = match v.get("speculative") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) => Some(
            m.parse::<Speculation>()
                .map_err(|e| ApiError::bad("speculative", e))?,
        ),
        Some(_) => {
            return Err(ApiError::bad(
                "speculative",
                "speculative must be \"mtp\", \"ngram\" or \"off\"",
            ))
        }
    };
    let draft = match number(v, "draft")? {
        None => None,
        Some(n) if n >= 0.0 && n.fract() == 0.0 && n <= 1e6 => Some(n as usize),
        Some(n) => {
            return Err(ApiError::bad(
                "draft",
                format!("draft {n} is not a whole number of tokens"),
            ))
        }
    };
    let speculation = st.batcher.speculation(mode, draft).map_err(|e| {
        ApiError::bad(
            if mode.is_some() {
                "speculative"
            } else {
                "draft"
            },
            e,
        )
    })?;
    let stream = match v.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad("stream", "stream must be true or false")),
    };
    Ok(Params {
        max_tokens,
        sampling: SamplingConfig {
            temperature: temperature as f32,
            top_k: 0,
            top_p: top_p as f32,
            repetition_penalty: 1.0,
            seed,
        },
        stop,
        stream,
        speculation,
    })
}

/// Which endpoint answers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// `POST /v1/completions`.
pub(super) async fn completions(State(st): State<ApiState>, body: Bytes) -> Response {
    let started = Instant::now();
    let ready = st.clone();
    let r = st
        .off_runtime(move || {
            let v = parse_body(&body)?;
            let p = params(&v, &ready)?;
            let prompt = match v.get("prompt") {
                Some(Value::String(s)) => s.as_str(),
                Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                    a[0].as_str().unwrap_or_default()
                }
                _ => return Err(ApiError::bad("prompt", "prompt is required: one string")),
            };
            let (tok, ctx) = (&ready.tokenizer, ready.batcher.ctx());
            prepare::fits_at_all(prompt, tok.longest_token_bytes(), ctx, "prompt")?;
            let tokens = tok
                .encode(prompt)
                .map_err(|e| ApiError::bad("prompt", format!("{e:#}")))?;
            Ok((p, tokens))
        })
        .await;
    match r {
        Ok((p, tokens)) => run(st, Kind::Completion, p, tokens, started).await,
        Err(e) => fail(&st, e),
    }
}

/// `POST /v1/chat/completions`: the conversation's own text stays text (a role marker in a
/// message is not a turn; see `TextTokenizer::encode_chat`).
pub(super) async fn chat_completions(State(st): State<ApiState>, body: Bytes) -> Response {
    let started = Instant::now();
    let ready = st.clone();
    let r = st
        .off_runtime(move || {
            let v = parse_body(&body)?;
            let p = params(&v, &ready)?;
            let inputs = super::chat::chat_inputs(&body)?;
            let tokens = ready
                .tokenizer
                .encode_chat(&inputs)
                .map_err(|e| ApiError::bad("messages", format!("{e:#}")))?;
            Ok((p, tokens))
        })
        .await;
    match r {
        Ok((p, tokens)) => run(st, Kind::Chat, p, tokens, started).await,
        Err(e) => fail(&st, e),
    }
}

/// Queues the generation and answers, whole or streamed.
async fn run(st: ApiState, kind: Kind, p: Params, tokens: Vec<u32>, started: Instant) -> Response {
    let param = if kind == Kind::Chat {
        "messages"
    } else {
        "prompt"
    };
    if tokens.is_empty() {
        return fail(&st, ApiError::bad(param, "the prompt encodes to no tokens"));
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let req = Request {
        prompt: tokens,
        max_tokens: p.max_tokens,
        sampling: p.sampling,
        stop: p.stop,
        speculation: p.speculation,
        events: tx,
    };
    if let Err(refusal) = st.batcher.submit(req) {
        let e = match refusal {
            Refusal::Busy(n) => ApiError::busy(format!(
                "the server is busy ({n} requests waiting): retry later"
            )),
            Refusal::TooLong { tokens, ctx } => ApiError::too_long(
                format!("the prompt has {tokens} tokens; the context holds {ctx}"),
                param,
            ),
            Refusal::Stopped => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: "the server is stopping".into(),
                kind: "server_error",
                param: None,
                code: None,
            },
        };
        return fail(&st, e);
    }
    let id = format!("cmpl-{}", st.metrics.next_id());
    if p.stream {
        stream(st, kind, id, rx, started)
    } else {
        whole(st, kind, id, rx, started).await
    }
}

fn fail(st: &ApiState, e: ApiError) -> Response {
    st.metrics.answered(e.status, e.into_response())
}

fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "stop",
        Finish::Length => "length",
    }
}

async fn whole(
    st: ApiState,
    kind: Kind,
    id: String,
    mut rx: mpsc::UnboundedReceiver<Event>,
    started: Instant,
) -> Response {
    let mut text = String::new();
    let mut timer = st.metrics.timer(started);
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Started => {}
            Event::Text(t) => {
                timer.token();
                text += &t;
            }
            Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            } => {
                let usage = json!({
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                });
                let choice = match kind {
                    Kind::Completion => json!({"index": 0, "text": text, "logprobs": null,
                        "finish_reason": finish_reason(finish)}),
                    Kind::Chat => json!({"index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": null, "finish_reason": finish_reason(finish)}),
                };
                let body = json!({
                    "id": id,
                    "object": if kind == Kind::Chat { "chat.completion" } else { "text_completion" },
                    "created": now(),
                    "model": st.model,
                    "choices": [choice],
                    "usage": usage,
                });
                return st.metrics.answered(StatusCode::OK, json_response(&body));
            }
            Event::Failed(why) => {
                return fail(&st, server_error(format!("the generation failed: {why}")))
            }
        }
    }
    fail(
        &st,
        server_error("the generation ended without an answer".into()),
    )
}

fn server_error(message: String) -> ApiError {
    ApiError::server(message)
}

fn stream(
    st: ApiState,
    kind: Kind,
    id: String,
    rx: mpsc::UnboundedReceiver<Event>,
    started: Instant,
) -> Response {
    let created = now();
    let object = if kind == Kind::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let chunk = move |delta: Option<&str>, finish: Option<Finish>, first: bool| -> Bytes {
        let choice = match kind {
            Kind::Completion => json!({"index": 0, "text": delta.unwrap_or(""), "logprobs": null,
                "finish_reason": finish.map(finish_reason)}),
            Kind::Chat => {
                let mut d = serde_json::Map::new();
                if first {
                    d.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = delta {
                    d.insert("content".into(), json!(t));
                }
                json!({"index": 0, "delta": d, "logprobs": null,
                    "finish_reason": finish.map(finish_reason)})
            }
        };
        let v = json!({"id": id, "object": object, "created": created, "model": st.model,
            "choices": [choice]});
        Bytes::from(format!("data: {}\n\n", json_body(&v)))
    };
    let metrics = st.metrics.clone();
    let mut timer = metrics.timer(started);
    let mut first = true;
    let events = tokio_stream_of(rx).filter_map(move |ev| {
        let out = match ev {
            Event::Started if kind == Kind::Chat => {
                first = false;
                Some(chunk(Some(""), None, true))
            }
            Event::Started => None,
            Event::Text(t) => {
                timer.token();
                Some(chunk(Some(&t), None, false))
            }
            Event::Done { finish, .. } => {
                let mut b = chunk(None, Some(finish), first).to_vec();
                b.extend_from_slice(b"data: [DONE]\n\n");
                Some(Bytes::from(b))
            }
            Event::Failed(why) => {
                tracing::warn!("a streamed generation failed: {why}");
                Some(Bytes::from(format!(
                    "data: {}\n\n",
                    json_body(&json!({"error": {"message": why, "type": "server_error"}}))
                )))
            }
        };
        std::future::ready(out.map(Ok::<_, std::convert::Infallible>))
    });
    let r = Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(events))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    metrics.answered(StatusCode::OK, r)
}

/// The events of `rx` as a stream, ending after the last one.
fn tokio_stream_of(
    mut rx: mpsc::UnboundedReceiver<Event>,
) -> impl futures::Stream<Item = Event> + Send {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
