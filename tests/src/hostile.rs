//! Raw HTTP/1.1 for hostile-request tests: requests no well-behaved client library would send
//! (a `Content-Length` that lies, a body that stalls, thousands of headers, bytes a header may
//! not hold), and a reader for whatever comes back.
//!
//! ```no_run
//! # async fn demo(addr: std::net::SocketAddr) {
//! use idempotency_tests::hostile::{RawRequest, exchange};
//!
//! let request = RawRequest::post("/charges")
//!     .header("idempotency-key", b"k-1")
//!     .content_length(1 << 30)
//!     .into_bytes();
//! let response = exchange(addr, &request).await.expect("a response");
//! assert_eq!(response.status, 413);
//! # }
//! ```

use std::{io, net::SocketAddr, time::Duration};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

use crate::suite::Reply;

/// The longest response head [`read_response`] accepts.
const MAX_HEAD: usize = 64 * 1024;

/// An HTTP/1.1 request head written byte by byte, so it may say anything.
#[derive(Debug, Clone)]
pub struct RawRequest {
    head: Vec<u8>,
}

impl RawRequest {
    /// `POST path` to the test app as account `acct_a` (`Host` and `Authorization` set).
    pub fn post(path: &str) -> Self {
        let mut head = format!("POST {path} HTTP/1.1\r\nHost: test\r\n").into_bytes();
        head.extend_from_slice(b"Authorization: Bearer acct_a\r\n");
        Self { head }
    }

    /// Adds `name: value`, with `value` written as given (controls, obs-text, anything).
    pub fn header(mut self, name: &str, value: &[u8]) -> Self {
        self.head.extend_from_slice(name.as_bytes());
        self.head.extend_from_slice(b": ");
        self.head.extend_from_slice(value);
        self.head.extend_from_slice(b"\r\n");
        self
    }

    /// Adds `Content-Length: length`, whatever the body will be.
    pub fn content_length(self, length: u64) -> Self {
        self.header("content-length", length.to_string().as_bytes())
    }

    /// The head, ended by the empty line; the body (if any) is for the caller to send.
    pub fn into_bytes(mut self) -> Vec<u8> {
        self.head.extend_from_slice(b"\r\n");
        self.head
    }

    /// The head followed by `body`, with a `Content-Length` that tells the truth.
    pub fn with_body(self, body: &[u8]) -> Vec<u8> {
        let mut bytes = self.content_length(body.len() as u64).into_bytes();
        bytes.extend_from_slice(body);
        bytes
    }
}

/// A form body of `size` bytes: `amount=100&currency=usd`, then `&a&a&a…`, about `size / 2`
/// pairs. With `reordered`, the two named pairs come the other way round.
pub fn repeated_pairs_form(size: usize, reordered: bool) -> Vec<u8> {
    let head: &[u8] = if reordered {
        b"currency=usd&amount=100"
    } else {
        b"amount=100&currency=usd"
    };
    let mut body = head.to_vec();
    while body.len() + 2 <= size {
        body.extend_from_slice(b"&a");
    }
    body
}

/// A JSON document of about `size` bytes: `depth` nested objects `{"z":…,"a":0}`, each with its
/// members out of order, around a padding string. With `reordered`, the outermost object is
/// written `{"a":0,"z":…}`: the same document, its members in another order.
pub fn deep_unordered_json(depth: usize, size: usize, reordered: bool) -> Vec<u8> {
    const OPEN: &[u8] = br#"{"z":"#;
    const CLOSE: &[u8] = br#","a":0}"#;
    let padding = size.saturating_sub(depth * (OPEN.len() + CLOSE.len()) + 2);
    let nested = depth.saturating_sub(1);
    let mut doc = if reordered {
        br#"{"a":0,"z":"#.to_vec()
    } else {
        OPEN.to_vec()
    };
    doc.extend(OPEN.repeat(nested));
    doc.push(b'"');
    doc.resize(doc.len() + padding, b'x');
    doc.push(b'"');
    doc.extend(CLOSE.repeat(nested));
    doc.extend_from_slice(if reordered { b"}" } else { CLOSE });
    doc
}

/// A response read off a raw connection.
#[derive(Debug, Clone)]
pub struct RawResponse {
    /// The status code.
    pub status: u16,
    /// The headers, in order.
    pub headers: HeaderMap,
    /// The body, de-chunked.
    pub body: Bytes,
}

impl RawResponse {
    /// As a [`Reply`], for its assertions ([`Reply::assert_problem`]).
    pub fn into_reply(self) -> Reply {
        Reply {
            status: StatusCode::from_u16(self.status).expect("a valid status"),
            headers: self.headers,
            body: self.body,
        }
    }
}

/// Connects to `addr`, sends `request`, and reads one response.
///
/// # Errors
///
/// When the connection fails or closes before a whole response was read.
pub async fn exchange(addr: SocketAddr, request: &[u8]) -> io::Result<RawResponse> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.write_all(request).await?;
    read_response(&mut stream).await
}

/// Reads one HTTP/1.1 response: its head, then a `Content-Length` or chunked body, or the rest
/// of the stream.
///
/// # Errors
///
/// When the stream fails or ends early, or the response is malformed.
pub async fn read_response(stream: &mut (impl AsyncRead + Unpin)) -> io::Result<RawResponse> {
    let mut buffer = Vec::new();
    let head_end = loop {
        if let Some(end) = find(&buffer, b"\r\n\r\n") {
            break end;
        }
        if buffer.len() > MAX_HEAD {
            return Err(invalid("response head too long"));
        }
        if read_some(stream, &mut buffer).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "connection closed after {} bytes of response head",
                    buffer.len()
                ),
            ));
        }
    };
    let head = std::str::from_utf8(&buffer[..head_end]).map_err(|_| invalid("head not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| invalid("malformed status line"))?;
    let mut headers = HeaderMap::new();
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| invalid("malformed header"))?;
        headers.append(
            HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| invalid("header name"))?,
            HeaderValue::from_str(value.trim()).map_err(|_| invalid("header value"))?,
        );
    }
    let mut rest = buffer.split_off(head_end + 4);
    let chunked = headers
        .get("transfer-encoding")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"chunked"));
    let body = if let Some(length) = headers.get("content-length") {
        let length: usize = length
            .to_str()
            .ok()
            .and_then(|l| l.parse().ok())
            .ok_or_else(|| invalid("content-length"))?;
        while rest.len() < length {
            if read_some(stream, &mut rest).await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        rest.truncate(length);
        rest
    } else if chunked {
        dechunk(stream, rest).await?
    } else {
        stream.read_to_end(&mut rest).await?;
        rest
    };
    Ok(RawResponse {
        status,
        headers,
        body: Bytes::from(body),
    })
}

/// Whether the server closed the connection: the next read ends (or fails) within `within`.
pub async fn is_closed(stream: &mut (impl AsyncRead + Unpin), within: Duration) -> bool {
    let mut byte = [0u8; 1];
    matches!(
        tokio::time::timeout(within, stream.read(&mut byte)).await,
        Ok(Ok(0) | Err(_))
    )
}

async fn dechunk(stream: &mut (impl AsyncRead + Unpin), mut rest: Vec<u8>) -> io::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = loop {
            if let Some(end) = find(&rest, b"\r\n") {
                break end;
            }
            if read_some(stream, &mut rest).await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        };
        let size = std::str::from_utf8(&rest[..line_end])
            .ok()
            .and_then(|line| usize::from_str_radix(line.split(';').next()?.trim(), 16).ok())
            .ok_or_else(|| invalid("chunk size"))?;
        rest.drain(..line_end + 2);
        while rest.len() < size + 2 {
            if read_some(stream, &mut rest).await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        if size == 0 {
            return Ok(body);
        }
        body.extend_from_slice(&rest[..size]);
        rest.drain(..size + 2);
    }
}

async fn read_some(
    stream: &mut (impl AsyncRead + Unpin),
    buffer: &mut Vec<u8>,
) -> io::Result<usize> {
    let mut chunk = [0u8; 8192];
    let n = stream.read(&mut chunk).await?;
    buffer.extend_from_slice(&chunk[..n]);
    Ok(n)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}
