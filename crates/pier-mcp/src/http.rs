//! The streamable-HTTP transport of an http MCP server: rmcp's client over a reqwest client we
//! build, so that TLS runs on ring (which pier already compiles) with the platform's roots.

use std::collections::HashMap;
use std::sync::Arc;

use agent_client_protocol_schema::v1::HttpHeader;
use reqwest::header::{HeaderName, HeaderValue};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rustls_platform_verifier::BuilderVerifierExt;

/// The transport to `url`, sending `headers` with every request. Errors are sentences for
/// [`crate::McpError::Config`].
pub(crate) fn transport(
    url: &str,
    headers: &[HttpHeader],
) -> Result<StreamableHttpClientTransport<reqwest::Client>, String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("its url `{url}` is not a valid URL: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!("its url `{url}` must start with http:// or https://"));
    }
    let mut custom = HashMap::new();
    for header in headers {
        let name = HeaderName::from_bytes(header.name.as_bytes())
            .map_err(|_| format!("its header name `{}` is not a valid HTTP header name", header.name))?;
        // The value is never echoed: headers carry credentials.
        let mut value = HeaderValue::from_str(&header.value)
            .map_err(|_| format!("the value of its header `{}` is not a valid HTTP header value", header.name))?;
        value.set_sensitive(true);
        custom.insert(name, value);
    }
    let config = StreamableHttpClientTransportConfig::with_uri(url).custom_headers(custom);
    Ok(StreamableHttpClientTransport::with_client(client()?, config))
}

fn client() -> Result<reqwest::Client, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|builder| builder.with_platform_verifier())
        .map_err(|e| format!("TLS could not be set up: {e}"))?
        .with_no_client_auth();
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        // As rmcp's own client: a reused idle connection can stall ~40 ms on delayed ACKs.
        .pool_max_idle_per_host(0)
        // A redirect would either drop the POST body (301-303) or replay the headers, which may
        // hold credentials, to wherever it points; a server must be configured with its real URL.
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| format!("its HTTP client could not be built: {e}"))
}
