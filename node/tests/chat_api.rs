//! The API's chat uses the model's template (here Qwen3.5's, as `--chat-template` gives it):
//! the prompt it renders from an OpenAI request with tools and tool calls is Python jinja2's
//! rendering (`data/templates/rendered.json`), and `usage.prompt_tokens` counts its tokens; a
//! model with no template, or a template that refuses, is a 400 saying why; `/tokenize` and
//! `/detokenize` answer in llama.cpp server's shapes.

use moeswarm_engine::generate::ModelSource;
use moeswarm_node::api::batcher::BatchOptions;
use moeswarm_node::api::Server;
use moeswarm_node::router::{OpenModel, Place};
use moeswarm_testkit::data;
use serde_json::{json, Value};

async fn server(template: Option<&str>) -> Server {
    let mut m = OpenModel::open(&Place::Local(ModelSource::Gguf(data("small-q4_k.gguf"))))
        .await
        .unwrap();
    if let Some(t) = template {
        let source = std::fs::read_to_string(data(&format!("templates/{t}"))).unwrap();
        m.tokenizer.set_chat_template(&source).unwrap();
    }
    let opts = BatchOptions::default();
    Server::start(m, "small".into(), opts, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

/// POSTs `body` to `path`: the status and the JSON answer.
async fn post(s: &Server, path: &str, body: &Value) -> (u16, Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = body.to_string();
    let mut sock = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    sock.read_to_string(&mut out).await.unwrap();
    let status = out[9..12].parse().unwrap();
    let json = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| serde_json::from_str(b).unwrap_or(Value::Null))
        .unwrap();
    (status, json)
}

/// The reference conversation `key` as an OpenAI client sends it (tool call arguments as a
/// JSON string), and jinja2's rendering of Qwen3.5's template for it.
fn reference(key: &str) -> (Value, String) {
    let text = std::fs::read_to_string(data("templates/rendered.json")).unwrap();
    let r: Value = serde_json::from_str(&text).unwrap();
    let mut conv = r["conversations"][key].clone();
    for m in conv["messages"].as_array_mut().unwrap() {
        let calls = m.get_mut("tool_calls").and_then(Value::as_array_mut);
        for call in calls.into_iter().flatten() {
            let args = call["function"]["arguments"].to_string();
            call["function"]["arguments"] = Value::String(args);
        }
    }
    let rendered = r["rendered"]["Qwen3.5-4B.jinja"][key]
        .as_str()
        .unwrap()
        .to_string();
    (conv, rendered)
}

async fn token_count(s: &Server, text: &str) -> usize {
    let (status, v) = post(s, "/tokenize", &json!({ "content": text })).await;
    assert_eq!(status, 200, "{v}");
    v["tokens"].as_array().unwrap().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_with_tools_is_rendered_as_jinja2_renders_the_models_template() {
    let s = server(Some("Qwen3.5-4B.jinja")).await;
    for key in [
        "tools, a call and its answer",
        "system, user, assistant, user",
    ] {
        let (conv, rendered) = reference(key);
        let mut body = json!({"model": "small", "max_tokens": 2, "temperature": 0});
        body["messages"] = conv["messages"].clone();
        if !conv["tools"].is_null() {
            body["tools"] = conv["tools"].clone();
        }
        let (status, v) = post(&s, "/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            v["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
            token_count(&s, &rendered).await,
            "{key}"
        );
    }
    // chat_template_kwargs reach the template.
    let (conv, rendered) = reference("thinking off");
    let body = json!({"model": "small", "max_tokens": 1, "messages": conv["messages"],
        "chat_template_kwargs": {"enable_thinking": false}});
    let (status, v) = post(&s, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
        token_count(&s, &rendered).await
    );
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_template_or_a_refusing_one_is_a_400_that_says_why() {
    // The test model's vocabulary has no ChatML markers and the file no template.
    let s = server(None).await;
    let body = json!({"model": "small", "messages": [{"role": "user", "content": "hi"}]});
    let (status, v) = post(&s, "/v1/chat/completions", &body).await;
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("no chat template"), "{msg}");
    // Completions still work.
    let (status, _) = post(
        &s,
        "/v1/completions",
        &json!({"model": "small", "prompt": "hi", "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);
    s.shutdown().await;

    let s = server(Some("Qwen3.5-4B.jinja")).await;
    let body = json!({"model": "small", "messages": [{"role": "assistant", "content": "hi"}]});
    let (status, v) = post(&s, "/v1/chat/completions", &body).await;
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("No user query found in messages."), "{msg}");
    // A role no template knows is refused before rendering.
    let body = json!({"model": "small", "messages": [{"role": "wizard", "content": "hi"}]});
    let (status, v) = post(&s, "/v1/chat/completions", &body).await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("messages")),
        "{v}"
    );
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_answer_as_llama_cpp_server() {
    let s = server(None).await;
    let text = "Héllo 🦙!";
    let (status, v) = post(&s, "/tokenize", &json!({ "content": text })).await;
    assert_eq!(status, 200, "{v}");
    let ids: Vec<Value> = v["tokens"].as_array().unwrap().clone();
    assert!(ids.iter().all(Value::is_u64) && !ids.is_empty());
    let (_, pieces) = post(
        &s,
        "/tokenize",
        &json!({ "content": text, "with_pieces": true }),
    )
    .await;
    let pieces = pieces["tokens"].as_array().unwrap();
    assert_eq!(pieces.len(), ids.len());
    // The pieces' bytes, in order, are the text; a piece that is not whole UTF-8 is bytes.
    let mut bytes = Vec::new();
    for (p, id) in pieces.iter().zip(&ids) {
        assert_eq!(&p["id"], id);
        match &p["piece"] {
            Value::String(s) => bytes.extend(s.as_bytes()),
            Value::Array(b) => bytes.extend(b.iter().map(|x| x.as_u64().unwrap() as u8)),
            other => panic!("{other}"),
        }
    }
    assert_eq!(bytes, text.as_bytes());
    assert!(
        pieces.iter().any(|p| p["piece"].is_array()),
        "the emoji is byte tokens here"
    );
    let (status, v) = post(&s, "/detokenize", &json!({ "tokens": ids })).await;
    assert_eq!((status, v["content"].as_str()), (200, Some(text)));
    // Bad input is a 400 naming the field.
    let (status, v) = post(&s, "/detokenize", &json!({ "tokens": [1, "x"] })).await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("tokens"))
    );
    let (status, v) = post(&s, "/detokenize", &json!({ "tokens": [99999999] })).await;
    assert_eq!(status, 400, "{v}");
    let (status, v) = post(&s, "/tokenize", &json!({ "text": "x" })).await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("content"))
    );
    s.shutdown().await;
}
