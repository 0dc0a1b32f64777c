//! The chat request's conversation made ready for the model's template, and llama.cpp
//! server's `/tokenize` and `/detokenize`.
//!
//! Messages are read from the request's bytes as they were sent (key order kept, as
//! transformers and llama.cpp see them: a tool's JSON schema reaches `tojson` in the client's
//! order). Each is checked (a role among system, developer, user, assistant, tool; text
//! content: a string, text parts, or none beside tool calls), `developer` becomes `system`,
//! text parts are joined, and a tool call's `arguments` JSON string becomes the object that
//! templates iterate over.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use minijinja::value::{Value as Jinja, ValueKind};
use moeswarm_engine::text::ChatInputs;
use serde_json::{json, Value};

use super::openai::{json_response, parse_body, ApiError};
use super::ApiState;

/// What the template reads from a chat request, in the order it was sent.
#[derive(serde::Deserialize)]
struct Conversation {
    messages: Option<Jinja>,
    #[serde(default)]
    tools: Option<Jinja>,
    #[serde(default)]
    chat_template_kwargs: Option<Jinja>,
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad("messages", message)
}

/// The template's inputs for the chat request `body`.
pub(super) fn chat_inputs(body: &Bytes) -> Result<ChatInputs, ApiError> {
    let c: Conversation = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", format!("the body is not a chat request: {e}")))?;
    let messages = match c.messages {
        Some(m) if m.kind() == ValueKind::Seq => m,
        _ => return Err(bad("messages is required: an array")),
    };
    let mut out = Vec::new();
    for (i, m) in messages
        .try_iter()
        .map_err(|e| bad(e.to_string()))?
        .enumerate()
    {
        out.push(message(i, &m)?);
    }
    if out.is_empty() {
        return Err(bad("messages is empty"));
    }
    let tools = match c.tools {
        None => None,
        Some(t) if t.is_none() => None,
        Some(t) if t.kind() == ValueKind::Seq => Some(t),
        Some(_) => return Err(ApiError::bad("tools", "tools must be an array")),
    };
    let mut extra = Vec::new();
    match c.chat_template_kwargs {
        None => {}
        Some(k) if k.is_none() => {}
        Some(k) if k.kind() == ValueKind::Map => {
            for key in k.try_iter().map_err(|e| bad(e.to_string()))? {
                let v = k.get_item(&key).unwrap_or_default();
                extra.push((key.to_string(), v));
            }
        }
        Some(_) => {
            return Err(ApiError::bad(
                "chat_template_kwargs",
                "chat_template_kwargs must be an object",
            ))
        }
    }
    Ok(ChatInputs {
        messages: Jinja::from(out),
        tools,
        add_generation_prompt: true,
        extra,
    })
}

/// Message `i`, checked and made ready for a template.
fn message(i: usize, m: &Jinja) -> Result<Jinja, ApiError> {
    if m.kind() != ValueKind::Map {
        return Err(bad(format!("messages[{i}] is not an object")));
    }
    let role = m.get_attr("role").ok();
    let role = match role.as_ref().and_then(|r| r.as_str()) {
        Some("developer") => "system",
        Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
        Some(r) => {
            return Err(bad(format!(
                "messages[{i}] has role {r:?}: system, developer, user, assistant or tool"
            )))
        }
        None => return Err(bad(format!("messages[{i}] needs a role (a string)"))),
    };
    let has_calls = m
        .get_attr("tool_calls")
        .is_ok_and(|t| !t.is_undefined() && !t.is_none());
    let mut fields: Vec<(String, Jinja)> = Vec::new();
    for key in m.try_iter().map_err(|e| bad(e.to_string()))? {
        let name = key.as_str().unwrap_or_default().to_string();
        let v = m.get_item(&key).unwrap_or_default();
        let v = match name.as_str() {
            "role" => Jinja::from(role),
            "content" => content(i, &v, has_calls)?,
            "tool_calls" if has_calls => tool_calls(i, &v)?,
            _ => v,
        };
        fields.push((name, v));
    }
    if !fields.iter().any(|(k, _)| k == "content") {
        if !has_calls {
            return Err(bad(format!("messages[{i}] has no content")));
        }
        fields.push(("content".into(), Jinja::from(())));
    }
    Ok(Jinja::from_iter(fields))
}

/// A message's content as templates read it: a string (text parts joined), or none beside
/// tool calls.
fn content(i: usize, v: &Jinja, has_calls: bool) -> Result<Jinja, ApiError> {
    match v.kind() {
        ValueKind::String => Ok(v.clone()),
        ValueKind::None | ValueKind::Undefined if has_calls => Ok(Jinja::from(())),
        ValueKind::Seq => {
            let mut text = String::new();
            for part in v.try_iter().map_err(|e| bad(e.to_string()))? {
                match part
                    .get_attr("text")
                    .ok()
                    .and_then(|t| t.as_str().map(str::to_string))
                {
                    Some(t) => text += &t,
                    None => {
                        return Err(bad(format!(
                            "messages[{i}].content has a part that is not text: only text is served"
                        )))
                    }
                }
            }
            Ok(Jinja::from(text))
        }
        _ => Err(bad(format!(
            "messages[{i}].content must be a string or an array of text parts"
        ))),
    }
}

/// Tool calls with each function's `arguments` JSON string read as the object it holds.
fn tool_calls(i: usize, v: &Jinja) -> Result<Jinja, ApiError> {
    if v.kind() != ValueKind::Seq {
        return Err(bad(format!("messages[{i}].tool_calls must be an array")));
    }
    let mut calls = Vec::new();
    for call in v.try_iter().map_err(|e| bad(e.to_string()))? {
        calls.push(map_field(&call, "function", |f| {
            map_field(f, "arguments", |a| match a.as_str() {
                Some(s) => serde_json::from_str::<Jinja>(s).map_err(|e| {
                    bad(format!(
                        "messages[{i}].tool_calls: arguments are not JSON: {e}"
                    ))
                }),
                None => Ok(a.clone()),
            })
        })?);
    }
    Ok(Jinja::from(calls))
}

/// `v` (a map) with field `name` replaced by `f` of it; anything else as it is.
fn map_field(
    v: &Jinja,
    name: &str,
    f: impl Fn(&Jinja) -> Result<Jinja, ApiError>,
) -> Result<Jinja, ApiError> {
    if v.kind() != ValueKind::Map {
        return Ok(v.clone());
    }
    let mut fields = Vec::new();
    for key in v.try_iter().map_err(|e| bad(e.to_string()))? {
        let item = v.get_item(&key).unwrap_or_default();
        let item = if key.as_str() == Some(name) {
            f(&item)?
        } else {
            item
        };
        fields.push((key.to_string(), item));
    }
    Ok(Jinja::from_iter(fields))
}

/// `POST /tokenize` (llama.cpp server's shape): `content`, `add_special` (default false),
/// `parse_special` (default true), `with_pieces` (default false) → `tokens`: ids, or
/// `{id, piece}` with the piece as a string when it is whole UTF-8, its bytes otherwise.
pub(super) async fn tokenize(State(st): State<ApiState>, body: Bytes) -> Response {
    let tok = st.tokenizer.clone();
    let r = st.off_runtime(move || -> Result<Value, ApiError> {
        let v = parse_body(&body)?;
        let Some(text) = v.get("content").and_then(Value::as_str) else {
            return Err(ApiError::bad("content", "content is required: a string"));
        };
        let flag = |k: &'static str, default: bool| match v.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(ApiError::bad(k, format!("{k} must be true or false"))),
        };
        let (add, parse, pieces) = (
            flag("add_special", false)?,
            flag("parse_special", true)?,
            flag("with_pieces", false)?,
        );
        let ids = tok
            .tokenize(text, add, parse)
            .map_err(|e| ApiError::bad("content", format!("{e:#}")))?;
        let tokens: Vec<Value> = ids
            .iter()
            .map(|&id| {
                if !pieces {
                    return json!(id);
                }
                let bytes = tok.piece(id).unwrap_or_default();
                match String::from_utf8(bytes) {
                    Ok(s) => json!({"id": id, "piece": s}),
                    Err(e) => json!({"id": id, "piece": e.into_bytes()}),
                }
            })
            .collect();
        Ok(json!({ "tokens": tokens }))
    });
    answer(&st, r.await)
}

/// `POST /detokenize` (llama.cpp server's shape): `tokens` → `content`, control tokens
/// written out.
pub(super) async fn detokenize(State(st): State<ApiState>, body: Bytes) -> Response {
    let tok = st.tokenizer.clone();
    let r = st.off_runtime(move || -> Result<Value, ApiError> {
        let v = parse_body(&body)?;
        let ids = v
            .get("tokens")
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|t| t.as_u64().and_then(|i| u32::try_from(i).ok()))
                    .collect::<Option<Vec<u32>>>()
            })
            .ok_or_else(|| ApiError::bad("tokens", "tokens is required: an array of token ids"))?;
        let text = tok
            .detokenize(&ids)
            .map_err(|e| ApiError::bad("tokens", format!("{e:#}")))?;
        Ok(json!({ "content": text }))
    });
    answer(&st, r.await)
}

/// The answer to a small request: its JSON, or its error; counted.
fn answer(st: &ApiState, r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => st
            .metrics
            .answered(axum::http::StatusCode::OK, json_response(&v)),
        Err(e) => st.metrics.answered(e.status(), e.into_response()),
    }
}
